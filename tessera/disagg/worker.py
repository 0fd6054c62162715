"""EngineWorker: one LLMEngine behind a small thread-safe API, run as a Ray actor (or in-process).

A worker serves whole requests (a data-parallel replica), prefills with handoff (a prefill
worker), or takes handoffs in (a decode worker); the role is only the router's choice of calls.
One thread owns the engine and steps it while there is work. Calls from the router queue an
operation that the engine thread applies between steps; `poll` long-polls the outputs of all
requests at once, so a step costs one message to the router whatever the batch size, not one
per token per stream.

Outputs travel as deltas only (`WorkerEvent`): new token ids, text and logprobs per choice. A
finished prefill's event carries the handoff, its K/V shipped by the worker's transport.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from tessera.config import EngineConfig
from tessera.disagg.transport import KVTransport, make_transport
from tessera.engine.handoff import SequenceHandoff
from tessera.engine.step_thread import hand_over_to_step_thread
from tessera.outputs import TokenLogprobs
from tessera.sampling import SamplingParams

logger = logging.getLogger("tessera.disagg")


@dataclass
class ChoiceDelta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs | None] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class WorkerEvent:
    request_id: str
    choices: list[ChoiceDelta]
    finished: bool  # no more events for this request from this worker
    num_cached_tokens: int = 0
    handoff: SequenceHandoff | None = None  # set: decode goes on elsewhere
    kv_ref: object = None  # the transport's reference to the handoff's K/V
    export_s: float = 0.0  # shipping the K/V (the copy out of the pool is part of the step)


@dataclass
class WorkerLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    steps: int = 0
    step_time_s: float = 0.0  # total time in engine.step()
    import_time_s: float = 0.0  # total time receiving and writing imported K/V
    num_imports: int = 0


@dataclass
class WorkerInfo:
    pid: int
    node_id: str
    max_num_seqs: int
    block_size: int
    num_blocks: int
    max_model_len: int
    transport: str


@dataclass
class _Op:
    apply: Callable[[], object]
    done: Future = field(default_factory=Future)


class EngineWorker:
    def __init__(self, config: EngineConfig, transport: str = "inproc") -> None:
        from tessera.engine.engine import LLMEngine

        self.engine = LLMEngine(config)
        self.transport: KVTransport = make_transport(transport)
        self.engine.kv_export_alloc = self.transport.alloc
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ready = threading.Condition(self._lock)
        self._ops: list[_Op] = []
        self._events: list[WorkerEvent] = []
        self._load = WorkerLoad()
        self._stopping = False
        self._error: BaseException | None = None
        hand_over_to_step_thread()  # the engine steps on a thread of its own (see there)
        self._thread = threading.Thread(target=self._run, name="tessera-worker", daemon=True)
        self._thread.start()

    # ---- the router's calls (any thread) ----------------------------------------------------

    def info(self) -> WorkerInfo:
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        except ImportError:
            node_id = "local"
        e = self.engine
        return WorkerInfo(os.getpid(), node_id, e.scheduler.max_num_seqs, e.kv.block_size, e.kv.num_usable_blocks,
                          e.max_model_len, self.transport.name)

    def ping(self) -> bool:
        return self._error is None

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, handoff: bool = False) -> None:
        """Queue a request (handoff: stop after the first token and ship the K/V); raises the
        engine's ValueError if it refuses it."""
        self._call(lambda: self.engine.add_request(request_id, prompt_ids, params, handoff=handoff))

    def import_handoff(self, handoff: SequenceHandoff, kv_ref: object = None) -> float:
        """Take over a handed-off (or orphaned, kv_ref None) sequence; returns the seconds spent
        receiving and writing its K/V."""
        start = time.perf_counter()
        kv = self.transport.receive(kv_ref) if kv_ref is not None else None

        def apply() -> float:
            self.engine.import_handoff(handoff, kv)
            return time.perf_counter() - start

        seconds = self._call(apply)
        if kv is not None:
            with self._lock:
                self._load.import_time_s += seconds
                self._load.num_imports += 1
        return seconds

    def discard(self, kv_ref: object) -> None:
        self.transport.discard(kv_ref)

    def abort(self, request_ids: list[str]) -> None:
        self._call(lambda: self.engine.abort_request(request_ids), wait=False)

    def poll(self, timeout_s: float = 1.0) -> tuple[list[WorkerEvent], WorkerLoad]:
        """Events since the last poll (waits up to timeout_s for one) and the current load."""
        with self._ready:
            if not self._events and self._error is None and not self._stopping:
                self._ready.wait(timeout_s)
            if self._error is not None:
                raise RuntimeError(f"the worker's engine failed: {self._error!r}")
            if self._stopping:
                raise RuntimeError("the worker is shut down")
            events, self._events = self._events, []
            return events, WorkerLoad(**vars(self._load))

    def check_invariants(self) -> None:
        self._call(self.engine.check_invariants)

    def shutdown(self) -> None:
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
        self._wake.set()
        self._thread.join(10)

    # ---- the engine thread ----------------------------------------------------------------

    def _call(self, fn: Callable[[], object], wait: bool = True):
        op = _Op(fn)
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"the worker's engine failed: {self._error!r}")
            if self._stopping:
                raise RuntimeError("the worker is shut down")
            self._ops.append(op)
        self._wake.set()
        return op.done.result() if wait else None

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._lock:
                    ops, self._ops = self._ops, []
                    if self._stopping:  # nobody may wait forever on an op that never runs
                        for op in ops:
                            op.done.set_exception(RuntimeError("the worker is shut down"))
                        return
                for op in ops:
                    try:
                        op.done.set_result(op.apply())
                    except Exception as exc:  # refused input: the caller gets it
                        op.done.set_exception(exc)
                if not engine.has_unfinished_requests():
                    self._publish([])
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                start = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - start
                events = [self._event(out) for out in outputs]
                with self._lock:
                    self._load.steps += 1
                    self._load.step_time_s += elapsed
                self._publish(events)
        except BaseException as exc:  # noqa: BLE001 - the router must hear of it
            logger.exception("worker engine thread crashed")
            with self._ready:
                self._error = exc
                self._ready.notify_all()
                stranded, self._ops = self._ops, []
            for op in stranded + (ops if "ops" in locals() else []):
                if not op.done.done():
                    op.done.set_exception(RuntimeError(f"the worker's engine failed: {exc!r}"))

    def _event(self, out) -> WorkerEvent:
        choices = [ChoiceDelta(c.index, c.delta_token_ids, c.delta_text, c.delta_logprobs, c.finish_reason,
                               c.stop_reason) for c in out.outputs]
        event = WorkerEvent(out.request_id, choices, out.finished,
                            out.metrics.num_cached_tokens if out.metrics is not None else 0)
        taken = self.engine.take_handoff(out.request_id)
        if taken is not None:
            start = time.perf_counter()
            event.handoff, kv = taken
            event.kv_ref = self.transport.ship(kv)
            event.export_s = time.perf_counter() - start
        return event

    def _publish(self, events: list[WorkerEvent]) -> None:
        stats = self.engine.stats()
        with self._ready:
            load = self._load
            load.num_running, load.num_waiting = stats.num_running, stats.num_waiting
            load.kv_cache_usage, load.num_free_blocks = stats.kv_cache_usage, stats.num_free_blocks
            load.prompt_tokens_total, load.generation_tokens_total = stats.prompt_tokens_total, \
                stats.generation_tokens_total
            load.prefix_cache_queries, load.prefix_cache_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            load.num_preemptions = stats.num_preemptions
            if events:
                self._events.extend(events)
                self._ready.notify_all()
