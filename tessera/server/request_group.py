"""The engine requests behind one HTTP request: added together, read together, aborted together.

A completions body with several prompts becomes one engine request per prompt. They are queued
at once (so the engine thread admits them in the same step), their outputs are merged as they
arrive, and whoever stops reading early (a disconnected client, an error, a cancelled handler)
aborts every one that is still running, which frees its KV blocks before the next step.

A group may carry an admission Ticket (given back when the group ends, however it ends) and a
timeout: at the deadline every unfinished request is aborted; a stream then ends its choices with
finish_reason "abort", a non-streamed request gets a 408. A server shutting down ends its groups the
same way (`end("shutdown")`): streams end with "abort", usage and [DONE]; a non-streamed request
gets a 503. Groups register in a `live` set so that the shutdown can find them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from starlette.requests import Request

from tessera.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError, RequestStream
from tessera.outputs import CompletionOutput, RequestOutput
from tessera.sampling import SamplingParams
from tessera.server.admission import Ticket
from tessera.server.errors import APIError, invalid_param

logger = logging.getLogger("tessera.server")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its requests have been aborted."""


class RequestGroup:
    def __init__(self, engine: AsyncLLMEngine, streams: list[RequestStream], prompts: list[list[int]],
                 params: SamplingParams, ticket: Ticket | None = None, timeout: float | None = None,
                 arrival_time: float | None = None, live: set[RequestGroup] | None = None) -> None:
        self.engine = engine
        self.streams = streams
        self.prompts = prompts
        self.n = params.n
        self.ticket = ticket
        self.timeout = timeout
        # Why the server ended the group before it finished: None, "timeout" or "shutdown".
        self.end_reason: str | None = None
        self._live = live
        if live is not None:
            live.add(self)
        self._last: dict[int, RequestOutput] = {}  # prompt index -> latest output
        self._timer: asyncio.TimerHandle | None = None
        if timeout is not None:
            start = arrival_time if arrival_time is not None else time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(max(0.0, start + timeout - time.monotonic()),
                                                                self._expire)

    @classmethod
    async def add(cls, engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                  arrival_time: float, ticket: Ticket | None = None, timeout: float | None = None,
                  live: set[RequestGroup] | None = None) -> RequestGroup:
        """Queue one engine request per prompt; a refused prompt aborts the rest and raises an APIError."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        try:
            results = await asyncio.gather(
                *(engine.add_request(rid, p, params, arrival_time) for rid, p in zip(ids, prompts, strict=True)),
                return_exceptions=True,
            )
        except BaseException:  # cancelled while queueing: add_request aborted its own
            if ticket is not None:
                ticket.release()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return cls(engine, list(results), prompts, params, ticket, timeout, arrival_time, live)
        engine.abort(ids)
        if ticket is not None:
            ticket.release()
        raise _api_error(errors[0])

    def abort_unfinished(self) -> None:
        """Abort whatever still runs and give the admission ticket back: the group is over."""
        unfinished = [s.request_id for s in self.streams if not s.finished]
        if unfinished:
            self.engine.abort(unfinished)
        if self._timer is not None:
            self._timer.cancel()
        if self.ticket is not None:
            self.ticket.release()
        if self._live is not None:
            self._live.discard(self)

    @property
    def timed_out(self) -> bool:
        return self.end_reason == "timeout"

    def _expire(self) -> None:
        if self.end("timeout"):
            logger.info("timeout after %gs; aborted %s", self.timeout, ", ".join(s.request_id for s in self.streams))
            if self.ticket is not None:
                self.ticket.timed_out()

    def end(self, reason: str) -> bool:
        """End every unfinished request now ("timeout" or "shutdown"): streams close with
        finish_reason "abort"; returns False when nothing was left running."""
        unfinished = [s.request_id for s in self.streams if not s.finished]
        if not unfinished or self.end_reason is not None:
            return False
        self.end_reason = reason
        self.engine.abort(unfinished)
        return True

    def _seen(self, i: int, out: RequestOutput) -> None:
        if i not in self._last and self.ticket is not None:
            self.ticket.started(i)
        self._last[i] = out

    def _timed_out_output(self, i: int) -> RequestOutput:
        """Prompt i's last output with every unfinished choice ended as "abort" (no new tokens)."""
        last = self._last.get(i)
        old = {c.index: c for c in last.outputs} if last is not None else {}
        outputs = []
        for j in range(self.n):
            c = old.get(j)
            if c is not None and c.finish_reason is not None:
                outputs.append(dataclasses.replace(c, delta_text="", delta_token_ids=[], delta_logprobs=[]))
            elif c is not None:
                outputs.append(dataclasses.replace(c, finish_reason="abort", delta_text="", delta_token_ids=[],
                                                   delta_logprobs=[]))
            else:
                outputs.append(CompletionOutput(index=j, text="", token_ids=[], finish_reason="abort",
                                                delta_logprobs=[]))
        return RequestOutput(request_id=self.streams[i].request_id, prompt=None, prompt_token_ids=self.prompts[i],
                             outputs=outputs, finished=True, metrics=last.metrics if last is not None else None)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs as they arrive; leaving early aborts whatever still runs."""
        if len(self.streams) == 1:
            try:
                try:
                    async for out in self.streams[0]:
                        self._seen(0, out)
                        yield 0, out
                except RequestAbortedError:
                    if self.end_reason is None:
                        raise
                    yield 0, self._timed_out_output(0)
            finally:
                self.abort_unfinished()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    self._seen(i, out)
                    queue.put_nowait((i, out))
            except RequestAbortedError as exc:
                queue.put_nowait((i, self._timed_out_output(i) if self.end_reason is not None else exc))
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
                    finals = work.result()
                except (EngineDeadError, RequestAbortedError) as exc:
                    raise _api_error(exc, in_flight=True) from None
                if self.timed_out:
                    raise APIError(408, f"the request did not finish within its timeout of {self.timeout:g} s "
                                        f"(the request's `timeout` field, capped by --request-timeout) and was "
                                        f"aborted", param="timeout", code="request_timeout")
                if self.end_reason == "shutdown":
                    raise APIError(503, "the server shut down before the request finished (it waited "
                                        "--shutdown-timeout seconds); retry on another replica or after the "
                                        "restart", code="server_shutting_down", headers={"Retry-After": "1"})
                return finals
            logger.info("client disconnected; aborting %s", ", ".join(s.request_id for s in self.streams))
            raise ClientDisconnected()
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
            self.abort_unfinished()


def _api_error(exc: BaseException, in_flight: bool = False) -> BaseException:
    if isinstance(exc, ValueError):
        return invalid_param(exc, "prompt")
    if in_flight and isinstance(exc, EngineDeadError) and exc.__cause__ is not None:
        # The engine crashed under this request: a server error; later requests get 503s.
        return APIError(500, f"{exc} (while serving this request); /health reports the engine down",
                        code="engine_failed")
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
