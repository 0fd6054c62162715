"""AsyncLLMEngine: the synchronous engine behind an asyncio front door.

One background thread owns the `LLMEngine` and is the only code that ever touches it. It drives
`engine.step()` while there is work and sleeps on an event when idle, so the event loop is never
blocked by a model step. Callers on the event loop never call the engine directly: adds and aborts
are queued under a lock and applied by the engine thread between steps, and each step's outputs
are handed back to the loop with one `call_soon_threadsafe` per step, landing in per-request
asyncio queues.

If the engine thread raises, every in-flight request fails with `EngineDeadError` and the engine
is marked unhealthy; later adds fail at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tessera.engine.step_thread import hand_over_to_step_thread
from tessera.outputs import RequestOutput
from tessera.sampling import SamplingParams

if TYPE_CHECKING:
    from tessera.config import EngineConfig
    from tessera.engine.engine import EngineStats, LLMEngine

logger = logging.getLogger("tessera.async_engine")


class EngineDeadError(RuntimeError):
    """The engine thread crashed (or was shut down); no request can be served any more."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (by `abort()` or a shutdown) before it finished."""


class StepObserver(Protocol):
    """Hooks the engine thread calls; metrics live behind it so the engine never imports the server.

    Both run on the engine thread: keep them cheap and never let them touch the event loop.
    """

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None: ...

    def on_abort(self, request_ids: list[str], now: float) -> None: ...


class RequestStream:
    """The async iterator of one request's outputs (each a delta plus running totals)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Event-loop side only."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


@dataclass
class _PendingAdd:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    stream: RequestStream
    accepted: asyncio.Future


class AsyncLLMEngine:
    """Thread-safe asyncio wrapper of one `LLMEngine`.

    `generate()` is the one call most callers need; `add_request()` + iterating the returned stream
    lets a caller see a bad prompt's ValueError before it commits to (say) an HTTP 200 stream.
    """

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None, idle_poll_s: float = 1.0,
                 warm_up: Callable[[LLMEngine], object] | None = None) -> None:
        """warm_up(engine), when given, runs on the engine thread before it takes any request, and
        the constructor returns once it is done (its error, if any, is raised here): the first
        steps at each shape then cost what later ones do on the thread that serves. Warmed on the
        loading thread instead, the engine thread's first burst still paid for its own allocator
        arena and OpenMP workers: 80-500k page faults against ~56k in later runs of a rate-inf
        `vllm bench serve` (Intel Xeon model 167), up to a fifth fewer tokens/s."""
        self.engine = engine
        self.observer = observer
        self._idle_poll_s = idle_poll_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}  # guarded by _lock
        self._live: set[str] = set()  # ids the engine holds; engine thread only
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = engine.stats()
        hand_over_to_step_thread()  # the engine steps on a thread of its own (see there)
        self._warm_up = warm_up
        self._warmed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)
        self._thread.start()
        if warm_up is not None:
            self._warmed.wait()
            if self._error is not None:
                raise RuntimeError(f"the warm-up failed: {self._error!r}") from self._error

    @classmethod
    def from_config(cls, config: EngineConfig, observer: StepObserver | None = None) -> AsyncLLMEngine:
        from tessera.engine.engine import LLMEngine

        return cls(LLMEngine(config), observer)

    # ---- public API (event loop side) -------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self._error is None and not self._stopping and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    def stats(self) -> EngineStats:
        """The engine's stats as of the end of its last step (a snapshot; safe from any thread)."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a request; returns once the engine thread accepted it.

        Raises the engine's ValueError (bad prompt, too long, id in use) or EngineDeadError.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop)
        pending = _PendingAdd(request_id, prompt, params,
                              time.monotonic() if arrival_time is None else arrival_time,
                              stream, loop.create_future())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._pending_adds.append(pending)
        self._wake.set()
        try:
            await pending.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been accepted a moment ago
            raise
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; stopping early aborts it in the engine."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for out in self.iterate(stream):
            yield out

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Iterate a stream from `add_request`, aborting the request if the consumer leaves early."""
        try:
            async for out in stream:
                yield out
        finally:
            # GeneratorExit (consumer stopped), CancelledError (client gone) or an error: free the
            # request's KV blocks now rather than generating for nobody.
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (thread-safe, non-blocking); the engine frees their blocks before its next step.

        Their streams end with RequestAbortedError if anyone still iterates them.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            streams = [s for s in (self._streams.pop(rid, None) for rid in ids) if s is not None]
            self._pending_aborts.extend(ids)
        self._wake.set()
        for stream in streams:
            if not stream.finished:
                _call_soon(stream.loop, stream.put, RequestAbortedError(f"request {stream.request_id} was aborted"))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort whatever is still in flight, stop the engine thread and wait for it."""
        with self._lock:
            ids = list(self._streams)
        if ids:
            logger.info("shutdown: aborting %d in-flight request(s)", len(ids))
            self.abort(ids)
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine failed earlier and cannot serve requests: {self._error!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _run(self) -> None:
        engine = self.engine
        try:
            if self._warm_up is not None:
                try:
                    self._warm_up(engine)
                except BaseException as exc:
                    self._error = exc  # before the constructor wakes and looks
                    raise
                finally:
                    self._warmed.set()
                self._stats = engine.stats()
            while True:
                with self._lock:
                    adds, self._pending_adds = self._pending_adds, []
                    aborts, self._pending_aborts = self._pending_aborts, []
                    stopping = self._stopping
                if aborts:
                    engine.abort_request(aborts)
                    # Only those the engine still held: not ones refused, finished, or aborted twice.
                    aborted = [rid for rid in dict.fromkeys(aborts) if rid in self._live]
                    self._live.difference_update(aborted)
                    if aborted and self.observer is not None:
                        self.observer.on_abort(aborted, time.monotonic())
                for add in adds:
                    self._apply_add(add)
                if aborts or adds:
                    self._stats = engine.stats()
                if stopping:
                    self._fail_streams(EngineDeadError("the engine was shut down"))
                    return
                if not engine.has_unfinished_requests():
                    # Wait for work; the timeout is only a safety net against a lost wake-up.
                    self._wake.wait(self._idle_poll_s)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                now = time.monotonic()
                self._stats = stats = engine.stats()
                if self.observer is not None:
                    try:
                        self.observer.on_step(outputs, stats, now)
                    except Exception:  # metrics must never take the engine down
                        logger.exception("step observer failed")
                if outputs:
                    self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - any crash must reach the waiting requests
            logger.exception("engine thread crashed; failing all in-flight requests")
            self._error = exc
            dead = EngineDeadError(f"the engine failed: {exc!r}")
            dead.__cause__ = exc
            self._fail_streams(dead)

    def _apply_add(self, add: _PendingAdd) -> None:
        with self._lock:
            # Aborted (or cancelled) while queued: never reaches the engine.
            wanted = self._streams.get(add.request_id) is add.stream
        if not wanted:
            aborted = RequestAbortedError(f"request {add.request_id} was aborted")
            _call_soon(add.stream.loop, _resolve, add.accepted, aborted)
            return
        try:
            self.engine.add_request(add.request_id, add.prompt, add.params, arrival_time=add.arrival_time)
        except Exception as exc:  # ValueError for bad input; anything else is reported the same way
            with self._lock:
                self._streams.pop(add.request_id, None)
            _call_soon(add.stream.loop, _resolve, add.accepted, exc)
            return
        self._live.add(add.request_id)
        _call_soon(add.stream.loop, _resolve, add.accepted, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._live.discard(out.request_id)
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted while the step ran
                if out.finished:
                    del self._streams[out.request_id]
                # Safe to hand over as is: the engine builds fresh CompletionOutputs (and copies of
                # the token lists) every step; readers use delta_logprobs, never the live logprobs.
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_streams(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            adds, self._pending_adds = self._pending_adds, []
        for add in adds:
            _call_soon(add.stream.loop, _resolve, add.accepted, exc)
        for stream in streams:
            _call_soon(stream.loop, stream.put, exc)


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass
