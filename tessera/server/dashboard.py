"""The live dashboard of `tessera serve`: GET /dashboard (and / redirects there), its static
script and style, and GET /v1/stats, the JSON it draws (also meant for scripts).

/v1/stats holds the figures of this moment (the same samples /metrics shows, read fresh), the
series of the last minutes (tessera/server/stats_series.py, sampled by a task that lives as long
as the app), the engine configuration in force, and the autopilot's decisions. It sits behind
`--api-key` like the rest of /v1; the page itself holds no data, so it is open and asks for the
key when /v1/stats answers 401.

Everything the page loads ships in tessera/server/static/ and the page's Content-Security-Policy
allows nothing but this server, so it works with no network (why hand-drawn SVG: docs/dashboard.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, RedirectResponse, Response

from tessera.server.stats_series import StatsHistory, snapshot, totals

# What the page may load: this server only (no CDN, no inline script).
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_STATIC = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}


@dataclasses.dataclass
class DashboardState:
    """Per-app dashboard state (app.state.dashboard); tests shorten `interval_s`."""

    history: StatsHistory
    interval_s: float = 2.0  # between snapshots, and between the page's refreshes


def decision_records(app: FastAPI) -> list[dict[str, Any]]:
    """The autopilot's and advisor's decisions, oldest first, as plain dicts with `wall_time`.

    The one place the dashboard reads them, tolerant of what exists: an autopilot's `decisions`
    records if it has them, else its `changes` (time, knob, old, new, reason); plus any advisor
    decisions a caller left in app.state.advisor_decisions. Records keep all their fields, so new
    figures a record gains show up without a change here."""
    records: list[dict[str, Any]] = []
    autopilot = getattr(app.state, "autopilot", None)
    if autopilot is not None:
        found = getattr(autopilot, "decisions", None)
        if callable(found):  # tessera.advisor.autopilot.Autopilot.decisions() returns a copy
            found = found()
        if found is None:
            found = getattr(autopilot, "changes", None)
        for rec in list(found or ()):
            records.append({"source": "autopilot", **_as_dict(rec)})
    for rec in list(getattr(app.state, "advisor_decisions", None) or ()):
        records.append({"source": "advisor", **_as_dict(rec)})
    # Engine times are time.monotonic(); the page wants wall-clock times.
    offset = time.time() - time.monotonic()
    for rec in records:
        t = rec.get("time")
        if isinstance(t, (int, float)) and "wall_time" not in rec:
            rec["wall_time"] = t + offset if t < 1e9 else t
    return sorted(records, key=lambda r: r.get("wall_time") or 0.0)


def _as_dict(rec: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(rec) and not isinstance(rec, type):
        return dataclasses.asdict(rec)
    if isinstance(rec, dict):
        return dict(rec)
    return dict(getattr(rec, "__dict__", {"value": str(rec)}))


def engine_settings(engine: Any) -> dict[str, Any]:
    """The configuration the engine was started with, and the knobs as they are now (the
    autopilot turns some while serving). Empty where the engine is not an in-process LLMEngine
    (the disaggregation router)."""
    inner = getattr(engine, "engine", None)
    config = getattr(inner, "config", None)
    configured = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {}
    in_force: dict[str, Any] = {}
    scheduler, kv = getattr(inner, "scheduler", None), getattr(inner, "kv", None)
    if scheduler is not None:
        in_force["max_num_batched_tokens"] = scheduler.max_num_batched_tokens
        # The budget of a step in which nothing decodes, where it differs (the autopilot's cuts).
        if (idle := getattr(scheduler, "prefill_only_budget", None)) is not None:
            in_force["prefill_only_budget"] = idle
        in_force["max_num_seqs"] = scheduler.max_num_seqs
    if kv is not None:
        in_force["enable_prefix_caching"] = kv.enable_prefix_caching
        in_force["num_kv_blocks"] = kv.num_usable_blocks
    return {"configured": configured, "in_force": in_force}


def install_dashboard(app: FastAPI, protected: APIRouter, engine: Any, registry, served_model_name: str) -> None:
    """Add the dashboard routes to `app` (the page) and `protected` (/v1/stats, behind the API
    key), and a sampling task to the app's lifespan."""
    state = DashboardState(StatsHistory())
    app.state.dashboard = state
    static = resources.files("tessera.server") / "static"

    async def sample_forever() -> None:
        while True:
            state.history.add(snapshot(registry))
            await asyncio.sleep(state.interval_s)

    inner_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: FastAPI):
        task = asyncio.create_task(sample_forever())
        try:
            async with inner_lifespan(app_) as maybe_state:
                yield maybe_state
        finally:
            task.cancel()

    app.router.lifespan_context = lifespan

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/dashboard", status_code=307)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        html = (static / "dashboard.html").read_text(encoding="utf-8")
        return Response(html, media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"})

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        if name not in _STATIC:
            return Response(status_code=404)
        return Response((static / name).read_bytes(), media_type=_STATIC[name],
                        headers={"Cache-Control": "no-cache"})

    async def stats(request: Request) -> JSONResponse:
        now = snapshot(registry)
        body = {
            "time": now.time,
            "model": served_model_name,
            "interval_s": state.interval_s,
            "window_s": state.interval_s * state.history.window,
            "totals": totals(now),
            "series": state.history.series(),
            "config": engine_settings(engine),
            "decisions": decision_records(request.app),
        }
        return JSONResponse(jsonable_encoder(body, custom_encoder={float: _finite}))

    protected.add_api_route("/v1/stats", stats, methods=["GET"])


def _finite(x: float) -> float | None:
    # JSON has no NaN or Infinity (e.g. a ratio before any traffic).
    return x if x == x and x not in (float("inf"), float("-inf")) else None
