"""AsyncLLMEngine against a scripted fake engine: threading, delivery, aborts and failures.

The fake follows LLMEngine's public API and counts up from the prompt's last token, so every
expected output is known exactly; the server tests run the real engine end to end.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from tessera.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError
from tessera.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tessera.sampling import SamplingParams


class FakeEngine:
    def __init__(self, step_delay: float = 0.0, fail_at_step: int | None = None) -> None:
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.step_threads: set[int] = set()
        self.batch_sizes: list[int] = []
        self.num_steps = 0
        self.tokenizer = SimpleNamespace()
        self.max_model_len = 64

    def add_request(self, request_id, prompt, params, arrival_time=None):
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = dict(prompt=list(prompt), params=params, out=[],
                                         metrics=RequestMetrics(arrival_time=arrival_time or time.monotonic()))

    def abort_request(self, request_ids):
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.step_threads.add(threading.get_ident())
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("simulated kernel failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        self.batch_sizes.append(len(self.requests))
        outputs = []
        for rid, r in list(self.requests.items()):
            last = r["out"][-1] if r["out"] else r["prompt"][-1]
            r["out"].append(last + 1)
            done = len(r["out"]) >= r["params"].max_tokens
            c = CompletionOutput(index=0, text=" ".join(map(str, r["out"])), token_ids=list(r["out"]),
                                 finish_reason="length" if done else None, delta_text=f" {last + 1}",
                                 delta_token_ids=[last + 1])
            outputs.append(RequestOutput(rid, None, r["prompt"], [c], finished=done, metrics=r["metrics"]))
            if done:
                del self.requests[rid]
        return outputs

    def stats(self):
        return SimpleNamespace(num_running=len(self.requests), num_waiting=0, kv_cache_usage=0.0,
                               last_step_num_seqs=self.batch_sizes[-1] if self.batch_sizes else 0,
                               last_step_num_tokens=0)


@pytest.fixture
def fake():
    return FakeEngine()


@pytest.fixture
def engine(fake):
    eng = AsyncLLMEngine(fake)
    yield eng
    eng.shutdown()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def run_one(engine: AsyncLLMEngine, rid: str, prompt: list[int], max_tokens: int) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params(max_tokens), rid)]


def test_generate_streams_deltas_that_add_up(engine, fake):
    outs = asyncio.run(run_one(engine, "a", [10], 5))
    assert [o.outputs[0].delta_token_ids for o in outs] == [[11], [12], [13], [14], [15]]
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [11, 12, 13, 14, 15]
    assert "".join(o.outputs[0].delta_text for o in outs) == " 11 12 13 14 15"
    assert fake.step_threads and threading.get_ident() not in fake.step_threads


def test_concurrent_requests_share_steps(engine, fake):
    async def main():
        return await asyncio.gather(*(run_one(engine, f"r{i}", [100 * i], 4 + i) for i in range(8)))

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert outs[-1].outputs[0].token_ids == list(range(100 * i + 1, 100 * i + 5 + i))
    assert max(fake.batch_sizes) > 1
    assert len(fake.step_threads) == 1  # one engine thread drives every step


def test_event_loop_is_not_blocked_by_steps():
    # Each step waits until a coroutine on the event loop has run during it: were the steps run on
    # the loop (or holding it), that coroutine could not run and the step would give up waiting.
    fake = FakeEngine()
    in_step, loop_ran = threading.Event(), threading.Event()
    seen: list[bool] = []
    real_step = fake.step

    def step():
        loop_ran.clear()
        in_step.set()
        seen.append(loop_ran.wait(10))
        return real_step()

    fake.step = step
    engine = AsyncLLMEngine(fake)

    async def watcher(stop: asyncio.Event):
        while not stop.is_set():
            if in_step.is_set():
                in_step.clear()
                loop_ran.set()
            await asyncio.sleep(0.001)

    async def main():
        stop = asyncio.Event()
        t = asyncio.ensure_future(watcher(stop))
        await run_one(engine, "slow", [1], 6)
        stop.set()
        await t

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert seen == [True] * 6


def test_consumer_leaving_early_aborts_in_engine(engine, fake):
    async def main():
        # Never long enough to finish on its own (1000 tokens raced the consumer on a fast machine).
        gen = engine.generate([1], params(10**9), "leaver")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()
        for _ in range(200):
            if not fake.requests:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert fake.aborted == ["leaver"] and not fake.requests
    assert engine.num_in_flight == 0


def test_cancelled_consumer_aborts_in_engine():
    fake = FakeEngine(step_delay=0.01)
    engine = AsyncLLMEngine(fake)

    async def main():
        task = asyncio.ensure_future(run_one(engine, "cancelled", [1], 10_000))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not fake.requests:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert fake.aborted == ["cancelled"] and not fake.requests


def test_bad_request_raises_and_engine_keeps_serving(engine, fake):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad", [], params(3))
        return await run_one(engine, "good", [5], 3)

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].token_ids == [6, 7, 8]
    assert engine.is_healthy


def test_duplicate_request_id_is_refused(engine):
    async def main():
        stream = await engine.add_request("dup", [1], params(10_000))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("dup", [1], params(5))
        first = await stream.__anext__()
        engine.abort("dup")
        return first

    assert asyncio.run(main()).outputs[0].token_ids[0] == 2


def test_explicit_abort_ends_the_stream(engine, fake):
    # A millisecond a step: without it the engine thread could run all 10,000 steps (and finish
    # the request) while a loaded machine kept the event loop from reading the first output.
    fake.step_delay = 0.001

    async def main():
        stream = await engine.add_request("x", [1], params(10_000))
        first = await stream.__anext__()
        engine.abort("x")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        return first

    assert asyncio.run(main()).outputs[0].token_ids == [2]


def test_engine_failure_fails_in_flight_requests_and_marks_unhealthy():
    fake = FakeEngine(fail_at_step=3)
    engine = AsyncLLMEngine(fake)

    async def main():
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            await run_one(engine, "victim", [1], 100)
        with pytest.raises(EngineDeadError):
            await run_one(engine, "later", [1], 1)

    try:
        asyncio.run(main())
        assert not engine.is_healthy and isinstance(engine.error, RuntimeError)
    finally:
        engine.shutdown()


def test_shutdown_aborts_in_flight_and_stops_the_thread():
    fake = FakeEngine(step_delay=0.01)
    engine = AsyncLLMEngine(fake)

    async def main():
        stream = await engine.add_request("inflight", [1], params(10_000))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises((RequestAbortedError, EngineDeadError)):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="shutting down"):
            await engine.add_request("after", [1], params(1))

    asyncio.run(main())
    assert not engine._thread.is_alive()
    assert "inflight" in fake.aborted and not fake.requests


def test_observer_sees_every_step_on_the_engine_thread(fake):
    seen = []

    class Observer:
        def on_step(self, outputs, stats, now):
            seen.append((threading.get_ident(), [o.request_id for o in outputs]))

        def on_abort(self, request_ids, now):
            seen.append((threading.get_ident(), ["abort"] + list(request_ids)))

    engine = AsyncLLMEngine(fake, observer=Observer())
    try:
        asyncio.run(run_one(engine, "o", [1], 3))
    finally:
        engine.shutdown()
    assert [ids for _, ids in seen] == [["o"], ["o"], ["o"]]
    assert {tid for tid, _ in seen} == fake.step_threads


def test_the_warm_up_runs_on_the_engine_thread_before_the_constructor_returns(fake):
    """The warm-up steps on the thread that later serves (its allocator arena and OpenMP workers
    are the ones that get warm), and no request is taken before it is done."""
    warmed_on = []

    def warm_up(eng):
        time.sleep(0.05)  # the constructor must still be waiting
        eng.add_request("warm", [1], params(2))
        while eng.has_unfinished_requests():
            eng.step()
        warmed_on.append(threading.get_ident())

    engine = AsyncLLMEngine(fake, warm_up=warm_up)
    try:
        assert warmed_on and warmed_on[0] != threading.get_ident()  # done, and not on this thread

        async def one():
            return [o async for o in engine.generate([5], params(2), "r")]

        outs = asyncio.run(one())
        assert outs[-1].outputs[0].token_ids == [6, 7]
        assert fake.step_threads == {warmed_on[0]}  # the warm-up's steps and the served ones: one thread
    finally:
        engine.shutdown()


def test_a_failed_warm_up_is_raised_by_the_constructor(fake):
    def warm_up(eng):
        raise RuntimeError("no kernels")

    with pytest.raises(RuntimeError, match="the warm-up failed.*no kernels"):
        AsyncLLMEngine(fake, warm_up=warm_up)
