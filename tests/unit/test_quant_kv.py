"""The quantized KV cache (--kv-cache-dtype int8 | fp8): the quantizer's error bounds, the torch
attention backend against a naive reference over the dequantized and over the float K/V, the
pool sizing, and the engine with prefix caching and swapping on a tiny model."""

from __future__ import annotations

import pytest
import torch

from tessera import SamplingParams
from tessera.attention.torch_cpu import TorchCPUAttention
from tessera.config import EngineConfig, ModelConfig
from tessera.engine.engine import LLMEngine
from tessera.engine.kv_sizing import num_kv_blocks
from tessera.quant.kv import dequantize, kv_bytes_per_token, quantize
from tests.unit.test_attention import build_step, naive_attention

CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantized_step(kv_dtype: str, composition: str, num_heads: int, head_dim: int, seed: int):
    """build_step's random step with its cache (history, padding block) stored quantized.
    Unwritten slots hold codes 0 / scale NaN, so reading one shows up as NaN."""
    q, k, v, (k_cache, v_cache), metadata, references = build_step(composition, num_heads, head_dim,
                                                                    torch.float32, seed)
    written = ~torch.isnan(k_cache[:, 0, 0])
    cache = []
    for c in (k_cache, v_cache):
        codes, scales = quantize(torch.nan_to_num(c), CODE_DTYPES[kv_dtype])
        scales[~written] = float("nan")
        cache.append((codes, scales))
    kv_cache = (cache[0][0], cache[1][0], cache[0][1], cache[1][1])
    return q, k, v, kv_cache, metadata, references


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantize_error_bounds(kv_dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, 64, generator=gen) * torch.rand(300, 4, 1, generator=gen) * 10
    x[0, 0] = 0  # an all-zero row
    codes, scales = quantize(x, CODE_DTYPES[kv_dtype])
    assert codes.dtype == CODE_DTYPES[kv_dtype] and scales.shape == (300, 4, 1)
    back = dequantize(codes, scales)
    assert torch.equal(back[0, 0], torch.zeros(64))
    amax = x.abs().amax(dim=-1, keepdim=True)
    if kv_dtype == "int8":
        assert codes.abs().max() == 127
        assert ((back - x).abs() <= scales / 2 * (1 + 1e-5)).all()  # half a step, per (token, head)
    else:
        # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 above its subnormal range.
        normal = x.abs() / scales >= 2**-6
        assert ((back - x).abs() <= x.abs() * 2**-4 * (1 + 1e-5))[normal].all()
    # The largest element of each row comes back (almost) exactly.
    picked = back.abs().amax(dim=-1, keepdim=True)
    torch.testing.assert_close(picked, amax, rtol=1e-6, atol=0)


# Tolerance of attention over int8 (fp8) K/V against float K/V, for unit-normal q, k, v: the
# int8 step is max|x| / 127 per element (fp8: 1/16 of the element), stated here and checked.
FLOAT_KV_TOL = {"int8": 0.03, "fp8": 0.12}


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("composition", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("group", [1, 4])
def test_attention_over_quantized_kv(kv_dtype, composition, group):
    num_heads, head_dim = 2 * group, 64
    q, k, v, kv_cache, metadata, references = quantized_step(kv_dtype, composition, num_heads, head_dim, seed=group)
    backend = TorchCPUAttention()
    backend.begin_step(metadata)
    out = backend.forward(0, q, k, v, kv_cache, metadata, head_dim**-0.5)
    assert not out.isnan().any()

    # The new tokens were quantized into their slots.
    new_codes, new_scales = quantize(k, CODE_DTYPES[kv_dtype])
    assert torch.equal(kv_cache[0][metadata.slot_mapping].view(torch.uint8), new_codes.view(torch.uint8))
    assert torch.equal(kv_cache[2][metadata.slot_mapping], new_scales)
    for rows, keys, values in references:
        # Exactly attention over the dequantized K/V (float rounding apart) ...
        kq, vq = (dequantize(*quantize(t, CODE_DTYPES[kv_dtype])) for t in (keys, values))
        expected = naive_attention(q[rows], kq, vq, head_dim**-0.5)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        # ... and within the stated tolerance of attention over the float K/V.
        exact = naive_attention(q[rows], keys, values, head_dim**-0.5)
        assert (out[rows] - exact).abs().max() < FLOAT_KV_TOL[kv_dtype]


def test_pool_holds_more_tokens_with_int8_kv():
    mc = ModelConfig(architecture="llama", vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64)  # the default model's shape
    assert kv_bytes_per_token(mc, torch.float32) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(mc, torch.float32, "int8") == kv_bytes_per_token(mc, torch.bfloat16, "fp8") \
        == 2 * 30 * 3 * (64 + 4)
    budget = 64 << 20
    blocks = {d: num_kv_blocks(EngineConfig(kv_cache_memory=budget, kv_cache_dtype=d, max_num_seqs=10**6), mc,
                               torch.float32, 8192) - 1 for d in ("auto", "int8")}
    assert blocks["auto"] == budget // (16 * 2 * 30 * 3 * 64 * 4)
    assert blocks["int8"] == budget // (16 * 2 * 30 * 3 * 68)
    assert blocks["int8"] / blocks["auto"] > 3.7  # 256 / 68 = 3.76


def test_flags_and_errors_name_the_flag(tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="torch attention backend only"):
        EngineConfig(kv_cache_dtype="int8", attention_backend="triton")
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8",
                                    kv_cache_memory=1 << 20))
    k_codes, v_codes, k_scales, v_scales = engine.runner.kv_caches[0]
    assert k_codes.dtype == v_codes.dtype == torch.int8 and k_codes.shape == (engine.runner.num_blocks * 16, 2, 16)
    assert k_scales.dtype == v_scales.dtype == torch.float32 and k_scales.shape == (engine.runner.num_blocks * 16, 2, 1)


# ---- the engine on the tiny model ------------------------------------------------------------

TINY_INT8_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * (16 + 4)  # K and V, 2 layers, 2 KV heads, 16 codes + a scale


def test_greedy_tokens_with_int8_kv_match_float_kv(tiny_model_dir):
    from tests.unit.test_engine import random_prompts

    prompts = random_prompts(8, 260, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for kv_dtype in ("auto", "int8"):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_dtype=kv_dtype,
                                        kv_cache_memory=4 << 20))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outs[kv_dtype] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[kv_dtype][out.request_id] = out.outputs[0].token_ids
    agree = [next((i for i, (a, b) in enumerate(zip(outs["auto"][rid], outs["int8"][rid], strict=True)) if a != b), 24)
             for rid in outs["auto"]]
    # A random tiny model's logits are nearly flat (top-2 gaps of a few 1e-3), the hardest case
    # for any perturbation; still, at most one sequence of 8 leaves the float KV's path.
    assert sum(n == 24 for n in agree) >= 7, f"tokens before the first difference: {agree}"


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_int8_kv_with_swapping_and_prefix_caching_equals_recompute(tiny_model_dir, prefix_caching):
    """Swap-mode preemption and prefix-cache hits move codes and scales together: the same
    greedy tokens as recomputing everything, with the same int8 KV cache."""
    from tests.unit.test_swap import BS, random_prompts, run

    prompts = random_prompts(16, 260, seed=0)
    prompts += [prompts[0][:12] + p[:8] for p in prompts[:4]]  # shared prefixes: prefix-cache hits

    def engine(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=BS,
                                      kv_cache_dtype="int8", kv_cache_memory=61 * BS * TINY_INT8_KV_BYTES_PER_TOKEN,
                                      max_num_batched_tokens=32, max_num_seqs=16,
                                      enable_prefix_caching=prefix_caching, **kw))

    recompute, swap = engine(preemption_mode="recompute"), engine(preemption_mode="swap", swap_space=0.01)
    assert recompute.runner.num_blocks == 1 + 61  # the padding block + what the int8 bytes per token buy
    out_recompute, _ = run(recompute, prompts)
    out_swap, _ = run(swap, prompts)
    assert out_swap == out_recompute
    s = swap.stats()
    assert s.num_preemptions > 0 and s.num_swapped_out_blocks > 0 and s.num_swapped_in_blocks > 0
    if prefix_caching:
        assert s.prefix_cache_hits > 0
