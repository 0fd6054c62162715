"""One log line for every refused request: method, path, status and the error's message.

Served requests get their line from metrics.py when they finish (queue, TTFT, e2e, tokens); a
request the server refuses (a 4xx from validation, auth, limits, the body guard; a 5xx) never
reaches the engine, so this ASGI middleware logs it from the response itself, on the same
`tessera.requests` logger (`--disable-log-requests` silences both).
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger("tessera.requests")


class RefusedRequestLog:
    """ASGI middleware: logs `METHOD PATH -> STATUS: message` for responses with status >= 400."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        logged = False

        async def send_and_log(message) -> None:
            nonlocal status, logged
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and not logged:
                logged = True
                level = logging.WARNING if status >= 500 else logging.INFO
                if status != 499:  # 499: the client left; its abort is logged by the metrics
                    logger.log(level, "%s %s -> %d: %s", scope["method"], scope["path"], status,
                               _error_message(message.get("body", b"")))
            await send(message)

        await self.app(scope, receive, send_and_log)


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace") or "(no body)"
