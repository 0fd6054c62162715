"""Prefill and decode workers as Ray actors behind the OpenAI server (one Ray session for the
module: Ray takes seconds to start). Streamed completions through 1 prefill + 2 decode workers
equal the colocated engine's greedy tokens; a decode worker killed with ray.kill mid-stream
loses no request, and every stream still carries exactly the colocated tokens, once each."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tessera import SamplingParams
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tests.unit.test_server import ServerThread

ray = pytest.importorskip("ray")

MODEL = "tiny"
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def engine_config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", kv_cache_memory=4096 * TINY_KV_BYTES_PER_TOKEN,
                        max_num_batched_tokens=64, num_threads=1)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from tessera.disagg.cluster import ClusterConfig
    from tessera.disagg.serve import create_disagg_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # Three actors on two CPUs: half a CPU each on paper; the tiny model needs little.
        app = create_disagg_app(engine_config(tiny_model_dir),
                                ClusterConfig(prefill_workers=1, decode_workers=2, worker_cpus=0.5),
                                served_model_name=MODEL)
        with ServerThread(app) as srv:
            yield srv
        app.state.engine.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    engine = LLMEngine(engine_config(tiny_model_dir))

    def greedy(prompts: list[list[int]], max_tokens: int) -> list[tuple[str, int]]:
        """(text, number of tokens) of each prompt's greedy completion on one engine."""
        for i, p in enumerate(prompts):
            engine.add_request(f"ref{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        return [(done[f"ref{i}"].text, len(done[f"ref{i}"].token_ids)) for i in range(len(prompts))]

    return greedy


def prompts_for(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(260) for _ in range(rng.randrange(8, 120))] for _ in range(count)]


async def stream_tokens(client, prompt: list[int], max_tokens: int, on_chunk=None) -> tuple[tuple[str, int], str]:
    """(streamed text, tokens streamed: one logprobs entry each) of one completion, and its finish
    reason. A token streamed twice or skipped changes both."""
    text, count, reason = "", 0, None
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, logprobs=0, extra_body={"ignore_eos": True})
    async for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        count += len(choice.logprobs.tokens) if choice.logprobs else 0
        reason = choice.finish_reason or reason
        if on_chunk is not None:
            on_chunk(count)
    return (text, count), reason


def test_openai_streams_through_prefill_and_decode_actors(server, reference):
    prompts = prompts_for(5, 6)
    expected = reference(prompts, 12)

    async def main():
        client = server.async_client()
        return await asyncio.gather(*(stream_tokens(client, p, 12) for p in prompts))

    results = asyncio.run(main())
    assert [r[0] for r in results] == expected
    assert all(r[1] == "length" for r in results)
    router = server.engine
    assert router.num_transfers >= len(prompts)
    metrics = __import__("httpx").get(server.base_url + "/metrics").text
    assert "tessera:kv_transfers_total" in metrics


def test_decode_actor_killed_mid_stream(server, reference):
    router = server.engine
    prompts = prompts_for(6, 8)
    expected = reference(prompts, 30)
    killed: list[str] = []

    def on_chunk(n: int) -> None:
        if killed or n < 5:
            return
        busy = [r.worker for r in router._reqs.values() if r.phase == "decode" and r.worker]
        if busy:
            victim = router.workers[max(set(busy), key=busy.count)]
            killed.append(victim.name)
            ray.kill(victim.actor, no_restart=False)  # Ray restarts it; the router moves its requests now

    async def main():
        client = server.async_client()
        return await asyncio.gather(*(stream_tokens(client, p, 30, on_chunk) for p in prompts))

    deaths_before = router.num_worker_deaths
    results = asyncio.run(main())
    assert killed, "no stream reached the point of the kill"
    assert router.num_worker_deaths > deaths_before and router.num_retried_requests >= 1
    assert [r[0] for r in results] == expected  # nothing lost, nothing streamed twice
    deadline = time.monotonic() + 60
    while len(router.alive) < len(router.workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(router.alive) == len(router.workers)  # restarted by Ray and back in service


def test_ray_object_store_transport_round_trip(server):
    import torch

    from tessera.disagg.transport import RayObjectStoreTransport

    t = RayObjectStoreTransport()
    buf = t.alloc((4096,), torch.uint8)
    buf.copy_(torch.arange(4096) % 253)
    ref = t.ship(buf)
    assert isinstance(ref[0], ray.ObjectRef)
    assert torch.equal(t.receive(ref), torch.arange(4096) % 253)
