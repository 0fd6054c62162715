"""The router: the server's engine when requests are served by worker processes (Ray actors).

It has the AsyncLLMEngine surface the HTTP server uses (add_request -> RequestStream, abort,
stats, tokenizer, ...), so the OpenAI front end is the same code. Two ways to use workers:

- disaggregated (prefill pool + decode pool): a request with n == 1 goes to a prefill worker,
  which computes the prompt's K/V and the first token (streamed at once), then ships the K/V; the
  router picks a decode worker, which imports them and streams the rest. Requests with n > 1 run
  whole on a decode worker.
- replicas (data parallel): every worker serves whole requests.

Workers are chosen by prefix, then load (tessera.disagg.routing). One pump task per worker
long-polls its events; a step costs one message per worker, not one per stream.

Faults: a call or poll that finds a worker gone marks it dead, and each of its requests is
served elsewhere: from scratch if the client has no token yet, otherwise resumed (n == 1) from
exactly the tokens and text the client has, on a live worker that recomputes their K/V. Events
of a worker that no longer owns a request are dropped, so nothing is streamed twice or skipped.
The pump then waits for Ray to restart the actor and puts it back in service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tessera.disagg.handles import WorkerDiedError, WorkerHandle
from tessera.disagg.routing import PrefixAwarePolicy, PrefixIndex, WorkerLoadView, prompt_block_hashes
from tessera.disagg.worker import WorkerEvent, WorkerLoad
from tessera.engine.async_engine import EngineDeadError, RequestAbortedError, RequestStream, StepObserver
from tessera.engine.engine import EngineStats
from tessera.engine.handoff import SequenceHandoff
from tessera.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tessera.sampling import SamplingParams

logger = logging.getLogger("tessera.disagg")


@dataclass
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    hashes: list[bytes]
    metrics: RequestMetrics
    choices: list[_Choice]
    worker: str | None = None  # the worker whose events count; None while between workers
    epoch: int = 0  # bumped at every reassignment: a stale failure handler sees it changed
    phase: str = "new"  # prefill | decode | full
    num_retries: int = 0

    @property
    def delivered_any(self) -> bool:
        return any(c.token_ids for c in self.choices)


@dataclass
class TransferRecord:
    num_tokens: int
    export_s: float  # shipping on the prefill worker
    import_s: float  # receiving and writing on the decode worker
    handoff_s: float  # router: prefill's event received -> decode worker has it


class DisaggRouter:
    def __init__(self, *, prefill: list[WorkerHandle] = (), decode: list[WorkerHandle] = (),
                 replicas: list[WorkerHandle] = (), tokenizer, model_config, max_model_len: int, block_size: int,
                 max_num_seqs: int, observer: StepObserver | None = None,
                 policy: PrefixAwarePolicy | None = None, poll_timeout_s: float = 1.0,
                 require_one_host: bool = False) -> None:
        if bool(prefill) != bool(decode):
            raise ValueError("disaggregation needs both --prefill-workers and --decode-workers >= 1")
        if not (prefill or replicas):
            raise ValueError("the router needs workers: --prefill-workers/--decode-workers or --data-parallel")
        self.prefill, self.decode, self.replicas = list(prefill), list(decode), list(replicas)
        self.workers = {h.name: h for h in (*self.prefill, *self.decode, *self.replicas)}
        self.tokenizer, self.model_config, self.max_model_len = tokenizer, model_config, max_model_len
        self.block_size = block_size
        self._max_num_seqs = max_num_seqs
        self.observer = observer
        self.policy = policy or PrefixAwarePolicy()
        self.poll_timeout_s = poll_timeout_s
        self.require_one_host = require_one_host  # the shared-memory KV transport
        self.alive: set[str] = set(self.workers)
        self.loads = {name: WorkerLoadView() for name in self.workers}
        self.worker_loads: dict[str, WorkerLoad] = {name: WorkerLoad() for name in self.workers}
        self.indexes: dict[str, PrefixIndex] = {}
        self._reqs: dict[str, _Request] = {}
        self._orphans: list[_Request] = []
        self._pumps: list[asyncio.Task] = []
        self._tasks: set[asyncio.Task] = set()
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.transfers: deque[TransferRecord] = deque(maxlen=4096)  # the latest, for percentiles
        self.transfer_totals = TransferRecord(0, 0.0, 0.0, 0.0)  # sums over all, for counters
        self.num_transfers = 0
        self.num_worker_deaths = 0
        self.num_retried_requests = 0

    # ---- the AsyncLLMEngine surface ------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return not self._stopping and bool(self.alive)

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def num_in_flight(self) -> int:
        return len(self._reqs)

    async def start(self) -> None:
        """Learn the workers' pools and start one pump per worker (on the running loop)."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            infos = await asyncio.gather(*(h.info() for h in self.workers.values()))
            nodes = {info.node_id for info in infos}
            if self.require_one_host and len(nodes) > 1:
                raise ValueError(f"the workers run on {len(nodes)} hosts but the KV transport is shared memory "
                                 f"(one host only); use --kv-transport ray")
            for h, info in zip(self.workers.values(), infos, strict=True):
                if info.block_size != self.block_size:
                    raise ValueError(f"worker {h.name} has block size {info.block_size}, the router {self.block_size}")
                self.indexes[h.name] = PrefixIndex(info.num_blocks)
            self._pumps = [asyncio.ensure_future(self._pump(h)) for h in self.workers.values()]
            self._started = True

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        if self._stopping:
            raise EngineDeadError("the router is shutting down")
        await self.start()
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                             f"{self.max_model_len} tokens; shorten the prompt or raise --max-model-len")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        req = _Request(request_id, prompt_ids, params, stream, prompt_block_hashes(prompt_ids, self.block_size),
                       RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()),
                       [_Choice() for _ in range(params.n)])
        self._reqs[request_id] = req
        try:
            await self._dispatch(req)
        except BaseException:
            self._reqs.pop(request_id, None)
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams, request_id: str, arrival_time: float | None = None):
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for out in self.iterate(stream):
            yield out

    async def iterate(self, stream: RequestStream):
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = []
        for rid in ids:
            req = self._reqs.pop(rid, None)
            if req is None:
                continue
            aborted.append(rid)
            if req.worker is not None and req.worker in self.alive:
                self._spawn(self._quiet(self.workers[req.worker].abort([rid])))
            self._release(req)
            if not req.stream.finished:
                req.stream.put(RequestAbortedError(f"request {rid} was aborted"))
        if aborted and self.observer is not None:
            self.observer.on_abort(aborted, time.monotonic())

    def stats(self) -> EngineStats:
        pools = [self.worker_loads[n] for n in self.workers if n in self.alive]
        serving = [self.worker_loads[h.name] for h in (*self.decode, *self.replicas) if h.name in self.alive]
        total_blocks = sum(ix.capacity_blocks for n, ix in self.indexes.items() if n in self.alive)
        free = sum(p.num_free_blocks for p in pools)
        queries = sum(p.prefix_cache_queries for p in pools)
        hits = sum(p.prefix_cache_hits for p in pools)
        return EngineStats(
            num_running=sum(p.num_running for p in serving), num_waiting=sum(p.num_waiting for p in pools),
            kv_cache_usage=max((p.kv_cache_usage for p in pools), default=0.0), num_free_blocks=free,
            num_total_blocks=total_blocks, num_preemptions=sum(p.num_preemptions for p in pools),
            prompt_tokens_total=sum(p.prompt_tokens_total for p in pools),
            generation_tokens_total=sum(p.generation_tokens_total for p in pools),
            last_step_num_seqs=0, last_step_num_tokens=0, prefix_cache_queries=queries, prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
        )

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self.abort(list(self._reqs))
        self._stopping = True
        for task in (*self._pumps, *self._tasks):
            task.cancel()
        for h in self.workers.values():
            try:
                h.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                logger.debug("shutting down %s failed", h.name, exc_info=True)

    # ---- dispatch --------------------------------------------------------------------------

    def _pool_for_new(self, req: _Request) -> tuple[list[WorkerHandle], bool]:
        """Candidates for a request starting from scratch, and whether it is handed off after prefill."""
        if self.prefill and req.params.n == 1:
            live = [h for h in self.prefill if h.name in self.alive]
            if live:
                return live, True
        live = [h for h in (self.decode or self.replicas) if h.name in self.alive]
        return live or [h for h in self.prefill if h.name in self.alive], False

    def _choose(self, pool: list[WorkerHandle], req: _Request, by_tokens: bool) -> WorkerHandle:
        names = [h.name for h in pool]
        name, _ = self.policy.choose(names, self.loads, self.indexes, req.hashes, by_tokens)
        return self.workers[name]

    def _assign(self, req: _Request, h: WorkerHandle, phase: str, prompt_tokens: int) -> int:
        req.worker, req.phase = h.name, phase
        req.epoch += 1
        load = self.loads[h.name]
        load.num_requests += 1
        load.num_prompt_tokens += prompt_tokens
        req._pending_tokens = prompt_tokens  # type: ignore[attr-defined]
        self.indexes[h.name].insert(req.hashes)
        return req.epoch

    def _release(self, req: _Request) -> None:
        """The request no longer runs on its worker (finished, moved, aborted)."""
        if req.worker is not None:
            load = self.loads[req.worker]
            load.num_requests -= 1
            load.num_prompt_tokens -= getattr(req, "_pending_tokens", 0)
            req._pending_tokens = 0  # type: ignore[attr-defined]
        req.worker = None

    async def _dispatch(self, req: _Request) -> None:
        """Send a request from scratch to a live worker (prefill worker if disaggregated).
        Raises ValueError if refused; parks it as an orphan when no worker is alive."""
        while True:
            pool, handoff = self._pool_for_new(req)
            if not pool:
                self._orphan(req)
                return
            h = self._choose(pool, req, by_tokens=handoff)
            epoch = self._assign(req, h, "prefill" if handoff else "full", len(req.prompt_ids))
            try:
                await h.add(req.request_id, req.prompt_ids, req.params, handoff)
                return
            except WorkerDiedError:
                if req.epoch == epoch:
                    self._release(req)
                self._mark_dead(h)
                if req.epoch != epoch or req.request_id not in self._reqs:
                    return  # the failover already took care of it
            except BaseException:
                self._release(req)
                raise

    async def _resume(self, req: _Request, handoff: SequenceHandoff, kv_ref: object = None,
                      received_at: float | None = None, export_s: float = 0.0) -> None:
        """Send a sequence that has tokens to a decode worker (or replica), with its K/V if any;
        with every decode worker down, to a prefill worker (it runs whole requests as well)."""
        while True:
            if req.request_id not in self._reqs:  # aborted while it travelled
                if kv_ref is not None:
                    await self._discard(handoff, kv_ref)
                return
            pool = [h for h in (self.decode or self.replicas) if h.name in self.alive]
            pool = pool or [h for h in self.prefill if h.name in self.alive]
            if not pool:
                if kv_ref is not None:
                    await self._discard(handoff, kv_ref)
                self._orphan(req)
                return
            h = self._choose(pool, req, by_tokens=False)
            epoch = self._assign(req, h, "decode", 0)
            try:
                import_s = await h.import_handoff(handoff, kv_ref)
            except WorkerDiedError:
                if req.epoch == epoch:
                    self._release(req)
                    self._mark_dead(h)
                    kv_ref = None  # the K/V may be half consumed: recompute on the next one
                    handoff = self._resume_point(req)
                    continue
                self._mark_dead(h)
                return
            except Exception as exc:  # refused (cannot fit): the client gets the error in-band
                self._release(req)
                self._fail(req, exc)
                return
            if kv_ref is not None and received_at is not None:
                record = TransferRecord(handoff.num_kv_tokens, export_s, import_s, time.monotonic() - received_at)
                self.transfers.append(record)
                totals = self.transfer_totals
                totals.num_tokens += record.num_tokens
                totals.export_s += record.export_s
                totals.import_s += record.import_s
                totals.handoff_s += record.handoff_s
                self.num_transfers += 1
            if req.request_id not in self._reqs:  # aborted while it travelled
                await self._quiet(h.abort([req.request_id]))
            return

    def _resume_point(self, req: _Request) -> SequenceHandoff:
        c = req.choices[0]
        return SequenceHandoff(req.request_id, req.prompt_ids, list(c.token_ids), req.params,
                               emitted_text_len=len(c.text),
                               output_logprobs=list(c.logprobs) if req.params.logprobs is not None else [])

    def _orphan(self, req: _Request) -> None:
        logger.warning("no live worker for request %s; it waits for a worker to come back", req.request_id)
        self._orphans.append(req)

    async def _recover(self, req: _Request) -> None:
        """Serve elsewhere a request whose worker died, from exactly what the client has."""
        if req.request_id not in self._reqs:
            return
        self.num_retried_requests += 1
        req.num_retries += 1
        try:
            if not req.delivered_any:
                await self._dispatch(req)
            elif req.params.n == 1:
                await self._resume(req, self._resume_point(req))
            else:
                self._fail(req, EngineDeadError(f"worker died after streaming tokens of request {req.request_id}; "
                                                f"requests with n > 1 cannot be resumed"))
        except Exception as exc:  # noqa: BLE001 - in-band to the client
            self._fail(req, exc)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        if self._reqs.pop(req.request_id, None) is not None:
            self._release(req)
            req.stream.put(exc)

    # ---- events ----------------------------------------------------------------------------

    async def _pump(self, h: WorkerHandle) -> None:
        while not self._stopping:
            try:
                events, load = await h.poll(self.poll_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dead or broken worker
                logger.warning("worker %s failed: %r", h.name, exc)
                self._mark_dead(h)
                await self._wait_for_revival(h)
                continue
            self.worker_loads[h.name] = load
            self.loads[h.name].kv_cache_usage = load.kv_cache_usage
            outputs = [out for ev in events if (out := self._on_event(h, ev)) is not None]
            if outputs and self.observer is not None:
                try:
                    self.observer.on_step(outputs, self.stats(), time.monotonic())
                except Exception:  # noqa: BLE001 - metrics never take the router down
                    logger.exception("step observer failed")

    def _on_event(self, h: WorkerHandle, ev: WorkerEvent) -> RequestOutput | None:
        req = self._reqs.get(ev.request_id)
        if req is None or req.worker != h.name:
            if ev.kv_ref is not None:  # aborted or moved: nobody will import it
                self._spawn(self._quiet(h.discard(ev.kv_ref)))
            return None
        now = time.monotonic()
        out = self._apply(req, ev, now)
        if ev.handoff is not None:
            self._release(req)
            req.phase = "decode"
            self._spawn(self._resume(req, ev.handoff, ev.kv_ref, now, ev.export_s))
        elif ev.finished:
            self._reqs.pop(req.request_id, None)
            self._release(req)
        if out is not None:
            req.stream.put(out)
        return out

    def _apply(self, req: _Request, ev: WorkerEvent, now: float) -> RequestOutput | None:
        deltas = {d.index: d for d in ev.choices}
        if not any(d.token_ids or d.text or d.finish_reason for d in deltas.values()):
            return None
        m = req.metrics
        if m.first_token_time is None and any(d.token_ids for d in deltas.values()):
            m.first_token_time = m.first_scheduled_time = now
            m.num_cached_tokens = ev.num_cached_tokens
        outputs = []
        with_lp = req.params.logprobs is not None
        for i, c in enumerate(req.choices):
            d = deltas.get(i)
            if d is not None and c.finish_reason is None:
                c.token_ids += d.token_ids
                c.text += d.text
                if with_lp and d.logprobs:
                    c.logprobs += d.logprobs
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                delta = (d.text, list(d.token_ids), list(d.logprobs or []) if with_lp else None)
            else:
                delta = ("", [], [] if with_lp else None)
            outputs.append(CompletionOutput(
                index=i, text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, logprobs=list(c.logprobs) if with_lp else None,
                delta_text=delta[0], delta_token_ids=delta[1], delta_logprobs=delta[2]))
        finished = all(c.finish_reason is not None for c in req.choices)
        if finished:
            m.finished_time = now
        return RequestOutput(req.request_id, None, req.prompt_ids, outputs, finished, m)

    # ---- faults ----------------------------------------------------------------------------

    def _mark_dead(self, h: WorkerHandle) -> None:
        if h.name not in self.alive:
            return
        self.alive.discard(h.name)
        self.num_worker_deaths += 1
        self.indexes[h.name].blocks.clear()  # a restarted worker starts with an empty cache
        victims = [r for r in self._reqs.values() if r.worker == h.name]
        logger.warning("worker %s is dead; %d request(s) move to live workers", h.name, len(victims))
        for req in victims:
            self._release(req)
            req.epoch += 1
            self._spawn(self._recover(req))

    async def _wait_for_revival(self, h: WorkerHandle, every_s: float = 0.5) -> None:
        """Until Ray has restarted the actor (a restart reloads the model: seconds)."""
        while not self._stopping:
            await asyncio.sleep(every_s)
            try:
                if await asyncio.wait_for(h.ping(), timeout=10.0):
                    break
            except Exception:  # noqa: BLE001 - still down
                continue
        if self._stopping:
            return
        logger.info("worker %s is back", h.name)
        self.alive.add(h.name)
        orphans, self._orphans = self._orphans, []
        for req in orphans:
            self._spawn(self._recover(req))

    # ---- plumbing --------------------------------------------------------------------------

    async def _discard(self, handoff: SequenceHandoff, kv_ref: object) -> None:
        for h in self.prefill:
            if h.name in self.alive:
                await self._quiet(h.discard(kv_ref))
                return

    def _spawn(self, coro) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # shutdown() off the loop: the workers are stopped anyway
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _quiet(coro) -> None:
        try:
            await coro
        except Exception:  # noqa: BLE001 - best effort (the worker may be gone)
            logger.debug("best-effort worker call failed", exc_info=True)
