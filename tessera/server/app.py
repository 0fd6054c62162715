"""The FastAPI app: routes wired to an AsyncLLMEngine, auth, health and Prometheus metrics.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as SSE with `stream: true`),
GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /metrics, and the live dashboard
(GET /dashboard, / redirects there, fed by GET /v1/stats; dashboard.py). Handlers live in
serving.py; what one HTTP request does to the engine lives in request_group.py.

Authentication (`--api-key` / TESSERA_API_KEY) covers /v1/* and the tokenize endpoints;
/health and /metrics stay open for probes and scrapers, as in vLLM. Limits and admission control
live in admission.py; CORS is off unless origins are given (`--allowed-origins`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from tessera.config import EngineConfig
from tessera.engine.async_engine import AsyncLLMEngine
from tessera.server.admission import AdmissionCollector, AdmissionController, RequestBodyGuard, ServerLimits
from tessera.server.dashboard import install_dashboard
from tessera.server.errors import APIError, error_response, install_error_handlers
from tessera.server.metrics import ServerMetrics
from tessera.server.request_group import ClientDisconnected
from tessera.server.request_log import RefusedRequestLog
from tessera.server.serving import OpenAIServer


def create_app(config: EngineConfig, served_model_name: str | None = None, api_key: str | None = None,
               limits: ServerLimits | None = None, allowed_origins: list[str] | None = None,
               tool_call_parser: str = "hermes", warmup: bool = True, kv_prefault: bool = True) -> FastAPI:
    """Load the engine for `config` (seconds) and build the app around it; the app owns the engine.
    warmup: run tessera.engine.warmup first (the socket is not served, so /health cannot answer
    before it is done); the metrics never see its requests. kv_prefault: fault the KV pool in on
    an idle-priority thread (tessera.engine.kv_prefault)."""
    from tessera.engine.engine import LLMEngine
    from tessera.engine.kv_prefault import KVPrefaulter
    from tessera.engine.warmup import warm_up

    name = served_model_name or config.model
    metrics = ServerMetrics(name)
    llm_engine = LLMEngine(config)
    # warmed on the thread that will step it (the constructor returns once that is done)
    engine = AsyncLLMEngine(llm_engine, observer=metrics, warm_up=warm_up if warmup else None)
    runner = llm_engine.runner
    prefault = KVPrefaulter(runner.kv_caches, runner.block_size).start() if kv_prefault else None
    app = build_app(engine, metrics, served_model_name=name, api_key=api_key, model_root=config.model,
                    limits=limits, allowed_origins=allowed_origins, tool_call_parser=tool_call_parser)
    app.state.kv_prefault = prefault
    return app


def build_app(engine: AsyncLLMEngine, metrics: ServerMetrics, *, served_model_name: str,
              api_key: str | None = None, model_root: str | None = None, owns_engine: bool = True,
              limits: ServerLimits | None = None, allowed_origins: list[str] | None = None,
              tool_call_parser: str = "hermes") -> FastAPI:
    """The app over a running AsyncLLMEngine (whose observer should be `metrics`), or anything
    with its surface (tessera.disagg's router); when the app owns the engine, its shutdown stops
    the engine thread."""
    metrics.bind_stats(engine.stats)
    limits = limits or ServerLimits()
    admission = AdmissionController(limits, engine.max_num_seqs)
    metrics.registry.register(AdmissionCollector(admission, served_model_name))
    server = OpenAIServer(engine, served_model_name, model_root, limits, admission, tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Tessera", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.served_model_name = served_model_name
    app.state.admission = admission
    app.state.drain = server.drain
    install_error_handlers(app)
    app.add_middleware(RequestBodyGuard, max_body_bytes=limits.max_body_bytes)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(RefusedRequestLog)  # outermost: it sees the body guard's and CORS's refusals too

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; keeps tracebacks out of the log

    protected = APIRouter(dependencies=[Depends(_api_key_check(api_key))] if api_key else [])
    protected.add_api_route("/v1/models", server.list_models, methods=["GET"])
    protected.add_api_route("/v1/completions", server.create_completion, methods=["POST"])
    protected.add_api_route("/v1/chat/completions", server.create_chat_completion, methods=["POST"])
    protected.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    protected.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    install_dashboard(app, protected, engine, metrics.registry, served_model_name)  # /dashboard, /v1/stats
    app.include_router(protected)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        reason = f"the engine failed: {engine.error!r}" if engine.error else "the engine is shutting down"
        return error_response(APIError(503, reason))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _api_key_check(api_key: str):
    expected = hashlib.sha256(api_key.encode()).digest()

    async def check_api_key(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest over digests: the time taken reveals neither how much of the key was
        # right nor its length.
        offered = hashlib.sha256(token.strip().encode()).digest()
        if not hmac.compare_digest(offered, expected) or scheme.lower() != "bearer":
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' with the key "
                                "the server was started with (--api-key / TESSERA_API_KEY)",
                           code="invalid_api_key")

    return check_api_key
