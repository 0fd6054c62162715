"""The router over in-process workers (no Ray): streams through prefill + decode workers equal
the colocated engine's greedy tokens; a decode worker killed mid-stream loses no request and
streams no token twice; data-parallel replicas route repeated prefixes to the replica that
caches them unless it is overloaded."""

from __future__ import annotations

import asyncio
import random

import pytest

from tessera import SamplingParams
from tessera.config import EngineConfig
from tessera.disagg.cluster import ClusterConfig, create_router
from tessera.disagg.routing import PrefixAwarePolicy, PrefixIndex, WorkerLoadView, prompt_block_hashes
from tessera.engine.engine import LLMEngine

TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", kv_cache_memory=2048 * TINY_KV_BYTES_PER_TOKEN,
                        max_num_batched_tokens=64, num_threads=1)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def reference(path, prompts, max_tokens) -> list[list[int]]:
    engine = LLMEngine(config(path))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(max_tokens))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


async def collect(router, rid, prompt, params, on_token=None) -> tuple[list[int], str, str]:
    tokens, text, reason = [], "", None
    async for out in router.generate(prompt, params, rid):
        c = out.outputs[0]
        tokens += c.delta_token_ids
        text += c.delta_text
        reason = c.finish_reason
        assert c.token_ids == tokens  # the running total is the sum of the deltas
        if on_token is not None:
            on_token(rid, len(tokens))
    return tokens, text, reason


def prompts_for(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(260) for _ in range(rng.randrange(5, 90))] for _ in range(count)]


def test_local_disaggregated_streams_equal_colocated(tiny_model_dir):
    prompts = prompts_for(1, 6)
    expected = reference(tiny_model_dir, prompts, 10)
    router = create_router(config(tiny_model_dir), ClusterConfig(prefill_workers=1, decode_workers=2, use_ray=False))

    async def main():
        return await asyncio.gather(*(collect(router, f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(main())
        assert [r[0] for r in results] == expected
        assert all(r[2] == "length" for r in results)
        assert router.num_transfers == len(prompts)  # every request went prefill -> decode
        for h in router.workers.values():
            h.worker.check_invariants()
    finally:
        router.shutdown()


def test_local_decode_worker_killed_mid_stream(tiny_model_dir):
    """Kill the decode worker serving most streams once they are a few tokens in: every request
    still finishes with exactly the colocated tokens, each streamed once."""
    prompts = prompts_for(2, 6)
    expected = reference(tiny_model_dir, prompts, 64)
    router = create_router(config(tiny_model_dir), ClusterConfig(prefill_workers=1, decode_workers=2, use_ray=False))
    killed = []

    def on_token(rid, n):
        if killed or n < 4:
            return
        # The router's view, not the client's: the tiny model may have finished a stream whose
        # tokens the client is still reading.
        busy = [r.worker for r in router._reqs.values() if r.phase == "decode" and r.worker]
        if busy:
            victim = router.workers[max(set(busy), key=busy.count)]
            killed.append(victim.name)
            victim.kill()

    async def main():
        return await asyncio.gather(*(collect(router, f"r{i}", p, greedy(64), on_token) for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(main())
        assert killed and router.num_worker_deaths == 1 and router.num_retried_requests >= 1
        assert [r[0] for r in results] == expected
    finally:
        router.shutdown()


def test_prefix_policy_prefers_the_cache_holder_unless_overloaded():
    policy = PrefixAwarePolicy(load_slack=4)
    hashes = prompt_block_hashes(list(range(64)), 16)
    indexes = {"a": PrefixIndex(100), "b": PrefixIndex(100)}
    indexes["b"].insert(hashes[:3])
    loads = {"a": WorkerLoadView(num_requests=1), "b": WorkerLoadView(num_requests=3)}
    assert policy.choose(["a", "b"], loads, indexes, hashes) == ("b", 3)
    loads["b"].num_requests = 6  # 5 more than a: past the slack
    assert policy.choose(["a", "b"], loads, indexes, hashes) == ("a", 0)
    assert policy.choose(["a", "b"], loads, indexes, prompt_block_hashes(list(range(100, 164)), 16))[0] == "a"
    indexes["a"].insert(hashes)  # a caches all 4 blocks now: the longer match wins
    assert policy.choose(["a", "b"], loads, indexes, hashes) == ("a", 4)


def test_prefix_index_is_an_lru_of_its_capacity():
    index = PrefixIndex(3)
    hashes = prompt_block_hashes(list(range(80)), 16)
    index.insert(hashes[:3])
    index.insert(hashes[3:5])
    assert index.match(hashes) == 0  # the head of the chain was evicted
    assert len(index.blocks) == 3


def test_local_data_parallel_routes_shared_prefixes_together(tiny_model_dir):
    """Two conversations, each sent three times with a growing tail: every turn of a
    conversation lands on the replica its first turn went to, and hits its prefix cache."""
    rng = random.Random(3)
    convs = [[rng.randrange(260) for _ in range(64)] for _ in range(2)]
    router = create_router(config(tiny_model_dir), ClusterConfig(data_parallel=2, use_ray=False))
    placed: dict[int, set[str]] = {0: set(), 1: set()}
    # Where each request was first sent, recorded as the router assigns it: a short request can
    # finish (and leave router._reqs, its worker cleared) before add_request returns to us.
    first_worker: dict[str, str] = {}
    assign = router._assign

    def recording_assign(req, h, phase, prompt_tokens):
        first_worker.setdefault(req.request_id, h.name)
        return assign(req, h, phase, prompt_tokens)

    router._assign = recording_assign

    async def main():
        for turn in range(3):  # both conversations' turns in flight together
            streams = []
            for c, prefix in enumerate(convs):
                prompt = prefix + [rng.randrange(260) for _ in range(3 + turn)]
                rid = f"c{c}-t{turn}"
                streams.append(await router.add_request(rid, prompt, greedy(4)))
                placed[c].add(first_worker[rid])
            for stream in streams:
                async for _ in router.iterate(stream):
                    pass

    try:
        asyncio.run(main())
        assert all(len(w) == 1 for w in placed.values())
        assert placed[0] != placed[1]  # the second conversation's first turn went to the idle replica
        assert router.stats().prefix_cache_hits >= 4 * 48  # turns 2 and 3 of both found 3+ blocks
    finally:
        router.shutdown()


@pytest.mark.parametrize("bad", [[], list(range(600))])
def test_router_refuses_bad_prompts(tiny_model_dir, bad):
    router = create_router(config(tiny_model_dir), ClusterConfig(data_parallel=2, use_ray=False))
    try:
        with pytest.raises(ValueError, match="prompt"):
            asyncio.run(router.add_request("x", bad, greedy(2)))
    finally:
        router.shutdown()


def test_shared_memory_transport_round_trip_and_cleanup():
    import os

    import torch

    from tessera.disagg.transport import SharedMemoryTransport

    t = SharedMemoryTransport()
    buf = t.alloc((1000,), torch.uint8)
    buf.copy_(torch.arange(1000) % 251)
    ref = t.ship(buf)
    assert os.path.exists(ref.path)
    got = t.receive(ref)
    assert not os.path.exists(ref.path)  # unlinked once mapped: nothing leaks past the import
    assert torch.equal(got, torch.arange(1000) % 251)
    dropped = t.ship(t.alloc((10,), torch.uint8))
    t.discard(dropped)
    assert not os.path.exists(dropped.path)
