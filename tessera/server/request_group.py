"""The engine requests behind one HTTP request: added together, read together, aborted together.

A completions body with several prompts becomes one engine request per prompt. They are queued
at once (so the engine thread admits them in the same step), their outputs are merged as they
arrive, and whoever stops reading early (a disconnected client, an error, a cancelled handler)
aborts every one that is still running, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.requests import Request

from tessera.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError, RequestStream
from tessera.outputs import RequestOutput
from tessera.sampling import SamplingParams
from tessera.server.errors import APIError, invalid_param

logger = logging.getLogger("tessera.server")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its requests have been aborted."""


class RequestGroup:
    def __init__(self, engine: AsyncLLMEngine, streams: list[RequestStream]) -> None:
        self.engine = engine
        self.streams = streams

    @classmethod
    async def add(cls, engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                  arrival_time: float) -> RequestGroup:
        """Queue one engine request per prompt; a refused prompt aborts the rest and raises an APIError."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(
            *(engine.add_request(rid, p, params, arrival_time) for rid, p in zip(ids, prompts, strict=True)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return cls(engine, list(results))
        engine.abort(ids)
        raise _api_error(errors[0])

    def abort_unfinished(self) -> None:
        unfinished = [s.request_id for s in self.streams if not s.finished]
        if unfinished:
            self.engine.abort(unfinished)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs as they arrive; leaving early aborts whatever still runs."""
        if len(self.streams) == 1:
            try:
                async for out in self.streams[0]:
                    yield 0, out
            finally:
                self.abort_unfinished()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as exc:
                queue.put_nowait((i, exc))
            queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            self.abort_unfinished()

    async def final_outputs(self, raw: Request) -> list[RequestOutput]:
        """Each prompt's final output, in prompt order; aborts them all if the client disconnects first."""

        async def read_all() -> list[RequestOutput]:
            finals: list = [None] * len(self.streams)
            async for i, out in self.outputs():
                finals[i] = out
            return finals

        work = asyncio.ensure_future(read_all())
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                try:
                    return work.result()
                except (EngineDeadError, RequestAbortedError) as exc:
                    raise _api_error(exc) from None
            logger.info("client disconnected; aborting %s", ", ".join(s.request_id for s in self.streams))
            raise ClientDisconnected()
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
            self.abort_unfinished()


def _api_error(exc: BaseException) -> BaseException:
    if isinstance(exc, ValueError):
        return invalid_param(exc, "prompt")
    if isinstance(exc, (EngineDeadError, RequestAbortedError)):
        return APIError(503, str(exc))
    return exc


async def _wait_for_disconnect(raw: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (uvicorn sends it when
    # the peer closes, or once the response is complete).
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
