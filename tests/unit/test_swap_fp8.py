"""The host KV tier with an fp8 KV cache (--kv-cache-dtype fp8): swap preemption and demotion copy
fp8 blocks, which CPU index_copy_ has no kernel for. Found by the differential fuzzer
(tests/differential): every swap-out with an fp8 cache raised NotImplementedError."""

from __future__ import annotations

import torch

from tessera import SamplingParams
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.engine.swap import HostKVCache
from tests.unit.test_engine import random_prompts

BS = 4


def test_host_cache_round_trip_of_fp8_blocks_is_exact():
    torch.manual_seed(0)
    codes = [torch.randn(8 * BS, 2, 3).to(torch.float8_e4m3fn) for _ in range(2)]
    scales = [torch.rand(8 * BS, 2) for _ in range(2)]
    device = [(codes[0], codes[1], scales[0], scales[1])]
    original = [t.clone() for t in device[0]]
    host = HostKVCache(device, num_blocks=4, block_size=BS)
    host.swap_out(device, [(3, 0), (1, 2)])
    host.swap_in(device, [(0, 5), (2, 6)])
    for d, o in zip(device[0], original, strict=True):
        d, o = d.view(torch.uint8) if d.dtype == torch.float8_e4m3fn else d, \
            o.view(torch.uint8) if o.dtype == torch.float8_e4m3fn else o
        assert torch.equal(d[5 * BS : 6 * BS], o[3 * BS : 4 * BS]) and torch.equal(d[6 * BS : 7 * BS], o[BS : 2 * BS])
        for b in (0, 1, 2, 3, 4, 7):
            assert torch.equal(d[b * BS : (b + 1) * BS], o[b * BS : (b + 1) * BS])


def test_swap_preemption_with_an_fp8_cache_equals_each_request_alone(tiny_model_dir):
    # fp8 KV: 2 layers x 2 KV heads x (16 one-byte codes + a 4-byte scale) x (K, V) = 160 bytes a token.
    bytes_per_token = 2 * 2 * 2 * (16 + 4)
    prompts = random_prompts(8, 260, seed=5, lo=10, hi=40)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cfg = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_dtype="fp8", block_size=BS)
    engine = LLMEngine(EngineConfig(**cfg, kv_cache_memory=30 * BS * bytes_per_token, preemption_mode="swap",
                                    swap_space=200 * BS * bytes_per_token / (1 << 30), max_num_batched_tokens=32))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    batched = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                batched[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
    assert engine.stats().num_swapped_out_blocks > 0, "the pool is meant to force swapping"
    alone = LLMEngine(EngineConfig(**cfg, enable_prefix_caching=False))
    for i, p in enumerate(prompts):
        alone.add_request("a", p, params)
        while alone.has_unfinished_requests():
            for out in alone.step():
                if out.finished:
                    assert out.outputs[0].token_ids == batched[str(i)], f"prompt {i}"
