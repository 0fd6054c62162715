"""Graceful shutdown of `tessera serve`: stop accepting, drain, then end what is left properly.

On SIGTERM or Ctrl-C, `DrainingServer` (a uvicorn.Server):
1. closes the listening sockets and the idle keep-alive connections, and `Drain.begin()` makes the
   routes answer any request that still arrives with a 503 (Retry-After);
2. waits up to `--shutdown-timeout` seconds for the requests in flight to finish on their own;
3. ends every request still running with `Drain.end_all()`: a stream sends its choices'
   finish_reason "abort", its usage (when asked for) and `[DONE]`; a non-streamed request gets a
   503; their KV blocks are freed;
4. lets uvicorn finish (the responses are complete by then, so nothing is cancelled) and stop the
   engine. The process exits 0 with no traceback.

A second Ctrl-C skips the wait (uvicorn's force exit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    import socket

    from tessera.server.request_group import RequestGroup

logger = logging.getLogger("tessera.server")

# After the requests have been ended, the seconds their last chunks get to reach the clients.
_FLUSH_TIMEOUT_S = 5.0


class Drain:
    """The live request groups of one app, and whether it still accepts new ones."""

    def __init__(self) -> None:
        self.groups: set[RequestGroup] = set()
        self.draining = False

    def begin(self) -> None:
        self.draining = True

    def end_all(self) -> int:
        """End every live group as "shutdown"; returns how many were still running."""
        return sum(group.end("shutdown") for group in list(self.groups))


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains in-flight requests before ending them (see module doc).

    `on_started` runs once the sockets are bound and the app is up (the "serving on" log line).
    """

    def __init__(self, config: uvicorn.Config, drain: Drain | None, shutdown_timeout: float,
                 on_started=None) -> None:
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle keep-alive connections close; busy ones close after their response
        if self.drain is not None:
            self.drain.begin()
        deadline = time.monotonic() + self.shutdown_timeout
        if self.server_state.tasks:
            logger.info("shutting down: waiting up to %gs (--shutdown-timeout) for %d request(s) in flight",
                        self.shutdown_timeout, len(self.server_state.tasks))
        while self.server_state.tasks and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if self.drain is not None:
            ended = self.drain.end_all()
            if ended:
                logger.info("shutting down: ended %d unfinished request(s) with finish_reason 'abort'", ended)
        # uvicorn's own shutdown now finds the responses complete or completing: it waits for
        # them (bounded), then runs the lifespan shutdown, which stops the engine.
        self.config.timeout_graceful_shutdown = _FLUSH_TIMEOUT_S
        await super().shutdown(sockets)
