"""Shared-prefix (cascade) decode attention equals the plain batched decode: the pure function
against the softmax formula, the CPU backend with and without decode_shared_len on one cache,
the model runner's detection of shared leading blocks, and greedy outputs of the engine on a
shared-prefix workload against transformers with the cascade path really taken."""

from __future__ import annotations

import random

import pytest
import torch

from tessera import SamplingParams
from tessera.attention import cascade, torch_cpu
from tessera.attention.cascade import cascade_decode_attention, shared_prefix_len
from tessera.attention.metadata import AttentionMetadata
from tessera.attention.torch_cpu import TorchCPUAttention
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tests.unit.test_engine import hf_greedy


def plain_attention(q, keys, values, bias):
    """softmax(q k^T + bias) v per sequence and KV head: q [B, Hkv, g, d], keys [B, Hkv, L, d]."""
    scores = q.double() @ keys.double().transpose(-1, -2)
    if bias is not None:
        scores = scores + bias.double()
    return (torch.softmax(scores, -1) @ values.double()).float()


@pytest.mark.parametrize("padding", [False, True])
def test_cascade_equals_attention_over_the_concatenated_context(padding):
    torch.manual_seed(0)
    batch, hkv, group, d, prefix, suffix = 5, 2, 3, 16, 40, 9
    q = torch.randn(batch, hkv, group, d)
    pk, pv = torch.randn(hkv, prefix, d), torch.randn(hkv, prefix, d)
    sk, sv = torch.randn(batch, hkv, suffix, d), torch.randn(batch, hkv, suffix, d)
    bias = None
    if padding:  # sequence b attends to its first suffix - b suffix positions
        lens = torch.tensor([suffix - b for b in range(batch)])
        bias = torch.zeros(batch, 1, 1, suffix).masked_fill(
            (torch.arange(suffix) >= lens.view(-1, 1)).view(batch, 1, 1, suffix), float("-inf"))
    keys = torch.cat([pk.unsqueeze(0).expand(batch, -1, -1, -1), sk], dim=2)
    values = torch.cat([pv.unsqueeze(0).expand(batch, -1, -1, -1), sv], dim=2)
    full_bias = None if bias is None else torch.cat([torch.zeros(batch, 1, 1, prefix), bias], dim=-1)
    got = cascade_decode_attention(q, pk, pv, sk, sv, bias)
    torch.testing.assert_close(got, plain_attention(q, keys, values, full_bias), atol=1e-5, rtol=1e-5)


def test_shared_prefix_len_counts_equal_leading_blocks_capped_by_the_shortest_context():
    bs = 16
    tables = torch.tensor([[3, 4, 5, 9, 0], [3, 4, 5, 7, 8], [3, 4, 5, 6, 0]])
    assert shared_prefix_len(tables, [60, 70, 55], bs) == 48
    assert shared_prefix_len(tables, [60, 70, 40], bs) == 40  # never past a sequence's context
    assert shared_prefix_len(tables[:1], [60], bs) == 0  # one sequence: nothing to share
    assert shared_prefix_len(torch.tensor([[3, 4], [5, 4]]), [30, 30], bs) == 0  # first blocks differ
    assert shared_prefix_len(torch.tensor([[3, 9], [3, 8]]), [30, 30], bs) == 0  # < MIN_SHARED_TOKENS


def test_backend_with_a_shared_prefix_equals_the_plain_decode():
    torch.manual_seed(1)
    bs, hkv, heads, d, num_blocks = 4, 2, 4, 8, 40
    k_cache = torch.randn(num_blocks * bs, hkv, d)
    v_cache = torch.randn(num_blocks * bs, hkv, d)
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # 36 shared positions
    own = [[20, 21], [22], [23, 24, 25]]
    ctx = [36 + 6, 36 + 3, 36 + 12]
    tables = [shared + o for o in own]
    max_ctx = max(ctx)
    slots = torch.tensor([[t[p // bs] * bs + p % bs if p < n else 0 for p in range(max_ctx)]
                          for t, n in zip(tables, ctx, strict=True)])
    mask = (torch.arange(max_ctx) < torch.tensor(ctx).view(-1, 1)).view(3, 1, 1, max_ctx)
    q = torch.randn(3, heads, d)
    k_new, v_new = k_cache[slots[[0, 1, 2], [c - 1 for c in ctx]]], v_cache[slots[[0, 1, 2], [c - 1 for c in ctx]]]

    def run(shared_len: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=slots[[0, 1, 2], [c - 1 for c in ctx]], num_decode_tokens=3,
                                 decode_slots=slots, decode_mask=mask, prefills=[], decode_shared_len=shared_len)
        backend = TorchCPUAttention()
        backend.begin_step(meta)
        return backend.forward(0, q, k_new, v_new, (k_cache, v_cache), meta, scale=d**-0.5)

    assert shared_prefix_len(torch.tensor([t + [0] * (12 - len(t)) for t in tables]), ctx, bs) == 36
    torch.testing.assert_close(run(36), run(0), atol=1e-5, rtol=1e-5)


def test_engine_with_cascade_decodes_matches_transformers(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []
    real = torch_cpu.cascade_decode_attention
    monkeypatch.setattr(torch_cpu, "cascade_decode_attention", lambda *a: calls.append(1) or real(*a))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = random.Random(7)
    vocab = hf.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(cascade.MIN_SHARED_TOKENS + 21)]
    prompts = [system + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    # The cascade is the torch backend's (the invariant kernel reads the prefix in place instead).
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4,
                                    kv_cache_memory=1 << 22, max_num_batched_tokens=256, attention_backend="torch"))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.add_request("first", prompts[0], params)  # computes the system prompt; the rest hit it
    engine.step()
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(str(i), p, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
    assert calls, "the shared-prefix decodes did not take the cascade path"
    for i, p in enumerate(prompts):
        assert results["first" if i == 0 else str(i)] == hf_greedy(hf, p, 10), i


def test_the_runner_measures_the_shared_prefix_only_for_the_cascade_backend(tiny_model_dir, monkeypatch):
    """The torch backend's cascade reads decode_shared_len; the invariant kernel does not, so its
    runner leaves it at 0 and skips the measurement."""
    from tessera import kernels
    from tessera.engine import model_runner

    if not kernels.available():
        pytest.skip("the invariant backend needs the C++ kernels")
    calls = []
    real = model_runner.shared_prefix_len
    monkeypatch.setattr(model_runner, "shared_prefix_len", lambda *a: calls.append(1) or real(*a))
    rng = random.Random(3)
    system = [rng.randrange(100) for _ in range(cascade.MIN_SHARED_TOKENS + 5)]
    for backend, measured in (("invariant", False), ("torch", True)):
        calls.clear()
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4,
                                        kv_cache_memory=1 << 22, attention_backend=backend))
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.add_request("0", system + [1], params)  # computes the system prompt; the others hit it
        engine.step()
        for i in range(1, 3):
            engine.add_request(str(i), system + [i + 1], params)
        seen: list = []

        def recording(*a, real_prepare=engine.runner.prepare, seen=seen, **k):
            step = real_prepare(*a, **k)
            seen.append(step)
            return step

        engine.runner.prepare = recording
        while engine.has_unfinished_requests():
            engine.step()
        assert bool(calls) == measured, backend
        shared = [s.metadata.decode_shared_len for s in seen if s.metadata.num_decode_tokens >= 2]
        assert shared and (all(n > 0 for n in shared) if measured else all(n == 0 for n in shared)), backend
