"""`tessera serve`: its flags (shaped like `vllm serve`) and the function that runs the server.

The socket is bound and the model path checked before the model loads, so a busy port or a wrong
path is reported at once; "serving ..." is logged once uvicorn listens. SIGTERM or Ctrl-C stops
the server gracefully (shutdown.py): no new connections, in-flight requests get
`--shutdown-timeout` seconds to finish, the rest end with finish_reason "abort" (streams get their
usage and [DONE]), then the engine thread is stopped and the process exits 0. If the engine thread
crashes, in-flight requests get a 500, /health a 503, and the server shuts down and exits 1, so a
supervisor restarts it rather than leaving it up and useless.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import threading
import time

from tessera.config import DEFAULT_MODEL, EngineConfig
from tessera.engine_args import UsageError, add_engine_arguments, engine_config, parse_memory
from tessera.server.shutdown import DrainingServer

logger = logging.getLogger("tessera.server")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help=f"Model: a Hugging Face folder, a .gguf file, or a packaged model name (default: "
                             f"{DEFAULT_MODEL}); --model works too.")
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="The model, as vLLM names it (the same as the positional argument).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for all interfaces).")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on.")
    parser.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer <key>' on /v1/* (default: $TESSERA_API_KEY, else none).")
    parser.add_argument("--served-model-name", default=None,
                        help="The model name clients send and /v1/models lists (default: the model argument).")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                        help="Level of Tessera's log.")
    parser.add_argument("--uvicorn-log-level", default=None,
                        choices=["debug", "info", "warning", "error", "critical", "trace"],
                        help="Level of uvicorn's own log (default: --log-level).")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="Skip the warm-up steps (a prefill and decodes at every batch-size bucket) that run "
                             "on the engine thread before /health answers; the first requests then pay the "
                             "first-run cost.")
    parser.add_argument("--no-kv-prefault", dest="kv_prefault", action="store_false",
                        help="Keep the KV pool lazy (resident only as far as it has been used) instead of faulting "
                             "it in on a background thread whenever a core is idle.")
    parser.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="No uvicorn line per HTTP request (Tessera's per-request line stays).")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="No Tessera line per request (finished, aborted, refused); vLLM's name.")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="Seconds in-flight requests get to finish after SIGTERM or Ctrl-C; then they end with "
                             "finish_reason 'abort'.")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="Sequences (n x prompts) accepted beyond a full batch; past it new requests get 503.")
    parser.add_argument("--max-waiting-tokens", type=int, default=None,
                        help="Prompt tokens accepted but not yet prefilled; past it new requests get 503 (default: "
                             "no limit).")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="Seconds after which a request is aborted; caps the request's own `timeout` field "
                             "(default: none).")
    parser.add_argument("--max-body-bytes", type=parse_memory, default=4 << 20,
                        help="Largest request body, e.g. 4MiB (413 beyond it).")
    parser.add_argument("--allowed-origins", default=None,
                        help="Comma-separated origins allowed by CORS, e.g. https://app.example (default: CORS off).")
    parser.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default="hermes",
                        help="How tool calls are read from the model's text for tool_choice auto (hermes: "
                             "<tool_call> JSON blocks; llama3_json: Llama 3 JSON).")
    add_engine_arguments(parser)
    from tessera.disagg.args import add_cluster_arguments

    add_cluster_arguments(parser)  # --prefill-workers, --decode-workers, --data-parallel, --ray-address, ...
    from tessera.advisor.commands import add_serve_advisor_arguments

    add_serve_advisor_arguments(parser)  # --config, --record-trace, --autopilot, --slo-ttft-ms, --slo-itl-ms


def serve_model(args: argparse.Namespace) -> str:
    """The model named by the positional argument or --model (the same one when both are given)."""
    positional, flag = args.model, getattr(args, "model_flag", None)
    if positional is not None and flag is not None and positional != flag:
        raise UsageError(f"two models given: {positional!r} and --model {flag!r}; give one")
    return positional or flag or DEFAULT_MODEL


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return engine_config(serve_model(args), args)


def server_limits_from_args(args: argparse.Namespace):
    from tessera.server.admission import ServerLimits

    try:
        return ServerLimits(max_waiting_requests=args.max_waiting_requests,
                            max_waiting_tokens=args.max_waiting_tokens, request_timeout=args.request_timeout,
                            max_body_bytes=args.max_body_bytes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def stop_when_engine_fails(engine, server, poll_s: float = 0.5) -> None:
    """Tell uvicorn to shut down once the engine thread has died (run in a daemon thread)."""
    while not server.should_exit:
        if engine.error is not None:
            logger.error("the engine failed (%r); shutting the server down", engine.error)
            server.should_exit = True
            return
        time.sleep(poll_s)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so that a busy port or a bad address is
    reported at once (uvicorn starts listening on it once the app is ready)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r} is not an address this machine can listen on ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is already in use (another server?): stop it, or pick another "
                          f"--port") from None
        if exc.errno == errno.EACCES:
            raise OSError(f"no permission to listen on port {port} (ports below 1024 need root): pick another "
                          f"--port") from None
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from tessera.engine.openmp_team import warn_if_passive
    from tessera.model.download import check_model_path
    from tessera.server.app import create_app

    # Everything a user can get wrong is checked before the model loads (which takes seconds).
    warn_if_passive()
    model = serve_model(args)
    check_model_path(model)
    for what, path in (("--tokenizer", args.tokenizer), ("--draft-model", args.draft_model)):
        if path is not None and path != "self":
            check_model_path(path, what)
    engine_config = engine_config_from_args(args)
    limits = server_limits_from_args(args)
    api_key = args.api_key or os.environ.get("TESSERA_API_KEY") or None
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    from tessera.disagg.args import cluster_config_from_args

    cluster = cluster_config_from_args(args)
    if cluster.enabled and getattr(args, "autopilot", False):
        raise UsageError("--autopilot drives one in-process engine; it does not run with --prefill-workers, "
                         "--decode-workers or --data-parallel")
    if args.disable_log_requests:
        logging.getLogger("tessera.requests").setLevel(logging.WARNING)
    sock = bind_socket(args.host, args.port)
    try:
        if cluster.enabled:  # workers on Ray behind a router (tessera.disagg)
            from tessera.disagg.serve import create_disagg_app

            app = create_disagg_app(engine_config, cluster, served_model_name=args.served_model_name,
                                    api_key=api_key, limits=limits, allowed_origins=origins)
        else:
            app = create_app(engine_config, served_model_name=args.served_model_name, api_key=api_key,
                             limits=limits, allowed_origins=origins,
                             tool_call_parser=args.tool_call_parser, warmup=args.warmup,
                             kv_prefault=args.kv_prefault)
        from tessera.advisor.commands import attach_serve_advisor

        attach_serve_advisor(app, args)
    except BaseException:
        sock.close()
        raise
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s without an API key: anyone who can reach the port can use the model "
                       "(set --api-key or TESSERA_API_KEY)", args.host)

    def serving() -> None:
        logger.info("serving %r on http://%s:%d%s", app.state.served_model_name, args.host, args.port,
                    " (API key required)" if api_key else "")

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level or args.log_level,
        access_log=args.access_log,
        timeout_keep_alive=5,
    )
    server = DrainingServer(config, getattr(app.state, "drain", None), args.shutdown_timeout, on_started=serving)
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
        server.run(sockets=[sock])  # returns after the graceful shutdown
    finally:
        engine.shutdown()  # a no-op when the lifespan already did it
        sock.close()
    if engine.error is not None:
        logger.error("server stopped because the engine failed: %r", engine.error)
        return 1
    logger.info("server stopped")
    return 0 if server.started else 1


def _after_shutdown_signal(signum: int, frame) -> None:
    pass  # the signal uvicorn re-raises after its graceful shutdown: already handled
