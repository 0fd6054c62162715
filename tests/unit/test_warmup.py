"""The warm-up leaves the engine as a fresh one: the same greedy tokens for the same request
(a fresh engine without warm-up is the reference), the same visible counters, an empty prefix
cache and the KV invariant intact."""

from __future__ import annotations

from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.engine.warmup import decode_batch_sizes, warm_up
from tessera.sampling import SamplingParams


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=8,
                                  max_num_batched_tokens=128, num_threads=1))


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            engine.check_invariants()
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_decode_batch_sizes_are_powers_of_two_and_the_maximum():
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert decode_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_warmed_engine_behaves_as_a_fresh_one(tiny_model_dir):
    prompts = [[5 + i, 17, 42, 99, 7, 150, 3 + i] * 5 for i in range(3)]
    fresh = make_engine(tiny_model_dir)
    before = fresh.stats()
    reference = generate(fresh, prompts)

    warmed = make_engine(tiny_model_dir)
    assert warm_up(warmed) >= 0.0
    stats = warmed.stats()
    assert stats == before  # every counter a user sees, as in a fresh engine
    assert warmed.kv.num_cached_blocks == 0 and not warmed.has_unfinished_requests()
    warmed.check_invariants()
    assert generate(warmed, prompts) == reference
    assert warmed.stats().prefix_cache_hits == fresh.stats().prefix_cache_hits
