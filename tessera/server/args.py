"""`tessera serve`: its flags (shaped like `vllm serve`) and the function that runs the server.

SIGTERM or Ctrl-C stops the server gracefully: uvicorn stops accepting connections, in-flight
requests get `--shutdown-timeout` seconds to finish, the rest are cancelled (which aborts them in
the engine), then the engine thread is stopped and the process exits 0. If the engine thread
crashes, in-flight requests get a 500, /health a 503, and the server shuts down and exits 1, so a
supervisor restarts it rather than leaving it up and useless.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time

from tessera.config import DEFAULT_MODEL, EngineConfig
from tessera.engine_args import add_engine_arguments, engine_kwargs, parse_memory

logger = logging.getLogger("tessera.server")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"HF folder, .gguf file, or the default model's name (default: {DEFAULT_MODEL})")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on /v1/* (default: $TESSERA_API_KEY, else none)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send and /v1/models lists (default: the model argument)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    parser.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="no uvicorn line per HTTP request (the per-request timing line stays)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="sequences (n x prompts) accepted beyond a full batch; past it new requests get 503")
    parser.add_argument("--max-waiting-tokens", type=int, default=None,
                        help="prompt tokens accepted but not yet prefilled; past it new requests get 503 (default: "
                             "no limit)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds after which a request is aborted; caps the request's own `timeout` field")
    parser.add_argument("--max-body-bytes", type=parse_memory, default=4 << 20,
                        help="largest request body, e.g. 4MiB (413 beyond it)")
    parser.add_argument("--allowed-origins", default=None,
                        help="comma-separated origins allowed by CORS, e.g. https://app.example (default: CORS off)")
    parser.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default="hermes",
                        help="how tool calls are read from the model's text for tool_choice auto (hermes: "
                             "<tool_call> JSON blocks; llama3_json: Llama 3 JSON)")
    add_engine_arguments(parser)
    from tessera.disagg.args import add_cluster_arguments

    add_cluster_arguments(parser)  # --prefill-workers, --decode-workers, --data-parallel, --ray-address, ...
    from tessera.advisor.commands import add_serve_advisor_arguments

    add_serve_advisor_arguments(parser)  # --config, --record-trace, --autopilot, --slo-ttft-ms, --slo-itl-ms


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, **engine_kwargs(args))


def server_limits_from_args(args: argparse.Namespace):
    from tessera.server.admission import ServerLimits

    return ServerLimits(max_waiting_requests=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens,
                        request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes)


def stop_when_engine_fails(engine, server, poll_s: float = 0.5) -> None:
    """Tell uvicorn to shut down once the engine thread has died (run in a daemon thread)."""
    while not server.should_exit:
        if engine.error is not None:
            logger.error("the engine failed (%r); shutting the server down", engine.error)
            server.should_exit = True
            return
        time.sleep(poll_s)


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from tessera.server.app import create_app

    api_key = args.api_key or os.environ.get("TESSERA_API_KEY") or None
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    from tessera.disagg.args import cluster_config_from_args

    cluster = cluster_config_from_args(args)
    if cluster.enabled:  # workers on Ray behind a router (tessera.disagg)
        from tessera.disagg.serve import create_disagg_app

        if getattr(args, "autopilot", False):
            raise SystemExit("--autopilot drives one in-process engine; it does not run with --prefill-workers, "
                             "--decode-workers or --data-parallel")
        app = create_disagg_app(engine_config_from_args(args), cluster, served_model_name=args.served_model_name,
                                api_key=api_key, limits=server_limits_from_args(args), allowed_origins=origins)
    else:
        app = create_app(engine_config_from_args(args), served_model_name=args.served_model_name, api_key=api_key,
                         limits=server_limits_from_args(args), allowed_origins=origins,
                         tool_call_parser=args.tool_call_parser)
    from tessera.advisor.commands import attach_serve_advisor

    attach_serve_advisor(app, args)
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s without an API key: anyone who can reach the port can use the model "
                       "(set --api-key or TESSERA_API_KEY)", args.host)
    logger.info("serving %r on http://%s:%d%s", app.state.served_model_name, args.host, args.port,
                " (API key required)" if api_key else "")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    if threading.current_thread() is threading.main_thread():
        # uvicorn handles SIGTERM/SIGINT itself while it runs, then restores the previous handlers
        # and re-raises the signal; with the default handler that would kill us after a clean
        # shutdown. A no-op handler here makes the re-raised signal harmless, so we exit 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _after_shutdown_signal)
    engine = app.state.engine
    threading.Thread(target=stop_when_engine_fails, args=(engine, server), name="tessera-watchdog",
                     daemon=True).start()
    try:
        server.run()  # returns after the graceful shutdown
    finally:
        engine.shutdown()  # a no-op when the lifespan already did it
    if engine.error is not None:
        logger.error("server stopped because the engine failed: %r", engine.error)
        return 1
    logger.info("server stopped")
    return 0 if server.started else 1


def _after_shutdown_signal(signum: int, frame) -> None:
    logger.info("received %s after the server stopped; exiting", signal.Signals(signum).name)
