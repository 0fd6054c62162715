"""The Triton attention kernels vs a plain PyTorch reference (softmax(QK^T)V, repeat_interleave).

Without a GPU the kernels run on CPU tensors in Triton's interpreter: this module sets
TRITON_INTERPRET=1 before triton is first imported (the kernels are built for the interpreter or
the GPU when they are decorated, at import). On a machine with CUDA it runs them on the GPU
(benchmarks/gpu/run.sh does), including bfloat16, which the interpreter mishandles in tl.dot.

Every case uses random lengths that are not multiples of the block size, shuffled blocks, and a
cache whose slots no sequence owns hold NaN, so reading a wrong block or an unmasked position
fails. Shapes are small: the interpreter runs each program op by op.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.triton_mode import gpu_or_interpreter

ON_GPU = gpu_or_interpreter()  # before triton is first imported

from tessera.attention.backend import get_attention_backend  # noqa: E402
from tessera.attention.metadata import AttentionMetadata, PrefillSpan, slots_for_positions  # noqa: E402
from tessera.attention.torch_cpu import TorchCPUAttention  # noqa: E402
from tessera.attention.triton_gpu import (  # noqa: E402
    TritonAttention,
    TritonAttentionConfig,
    choose_splits,
    kernels_interpreted,
)

if not ON_GPU and not kernels_interpreted():
    raise RuntimeError(
        "triton was imported before this module could set TRITON_INTERPRET=1, so its kernels were built "
        "for a GPU: run this file on its own, or with TRITON_INTERPRET=1 in the environment"
    )

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
BLOCK = 16


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, d]: the last n positions of a sequence whose K/V are k, v [m, Hkv, d]. float32."""
    n, num_heads, head_dim = q.shape
    m = k.shape[0]
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    causal = torch.arange(m).view(1, -1) <= torch.arange(n).view(-1, 1) + (m - n)
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return torch.einsum("hnm,mhd->nhd", probs, v).reshape(n, num_heads * head_dim)


def build_step(decode_contexts: list[int], spans: list[tuple[int, int]], num_kv_heads: int, group: int,
               head_dim: int, dtype: torch.dtype, seed: int):
    """A step of decodes (each with the given context, its new token included) then prefill spans
    (tokens already cached, new tokens). Returns (q, k, v, kv_cache, metadata, references) where
    references lists (rows of the step, all keys, all values) per sequence; tensors on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    seqs = [(ctx - 1, 1) for ctx in decode_contexts] + list(spans)
    num_blocks = 1 + sum(-(-(cached + new) // BLOCK) for cached, new in seqs) + 3
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: padding only

    shape = (num_blocks * BLOCK, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_cache[:BLOCK] = 1e3 * torch.randn(BLOCK, num_kv_heads, head_dim, generator=gen)
    v_cache[:BLOCK] = 1e3 * torch.randn(BLOCK, num_kv_heads, head_dim, generator=gen)

    num_tokens = sum(new for _, new in seqs)
    # q, k, v as strided views of one projection output, like the model passes them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)

    num_decodes = len(decode_contexts)
    width = max(decode_contexts, default=0) + 7  # padding columns point at block 0
    decode_slots = torch.zeros(num_decodes, width, dtype=torch.long)
    decode_mask = torch.zeros(num_decodes, 1, 1, width, dtype=torch.bool)
    slot_mapping, references, prefills = [], [], []
    token = 0
    for i, (cached, new) in enumerate(seqs):
        table, free = free[: -(-(cached + new) // BLOCK)], free[-(-(cached + new) // BLOCK) :]
        slots = torch.tensor(slots_for_positions(table, 0, cached + new, BLOCK))
        history_k = torch.randn(cached, num_kv_heads, head_dim, generator=gen).to(dtype)
        history_v = torch.randn(cached, num_kv_heads, head_dim, generator=gen).to(dtype)
        k_cache[slots[:cached]] = history_k
        v_cache[slots[:cached]] = history_v
        slot_mapping.append(slots[cached:])
        rows = slice(token, token + new)
        references.append((rows, torch.cat([history_k, k[rows]]), torch.cat([history_v, v[rows]])))
        if i < num_decodes:
            decode_slots[i, : cached + 1] = slots
            decode_mask[i, ..., : cached + 1] = True
        else:
            prefills.append(PrefillSpan(token, new, cached + new, slots.to(DEVICE)))
        token += new

    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping).to(DEVICE),
        num_decode_tokens=num_decodes,
        decode_slots=decode_slots.to(DEVICE) if num_decodes else None,
        decode_mask=decode_mask.to(DEVICE) if num_decodes else None,
        prefills=prefills,
    )
    kv_cache = (k_cache.to(DEVICE), v_cache.to(DEVICE))
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kv_cache, metadata, references


def check_backend(backend, decode_contexts, spans, num_kv_heads, group, head_dim, dtype, seed, tol):
    q, k, v, kv_cache, metadata, references = build_step(
        decode_contexts, spans, num_kv_heads, group, head_dim, dtype, seed)
    scale = head_dim**-0.5
    backend.begin_step(metadata)
    out = backend.forward(0, q, k, v, kv_cache, metadata, scale)
    assert out.shape == (q.shape[0], q.shape[1] * head_dim) and out.dtype == dtype
    torch.testing.assert_close(kv_cache[0][metadata.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(kv_cache[1][metadata.slot_mapping], v, rtol=0, atol=0)
    out = out.float().cpu()
    for rows, keys, values in references:
        expected = reference_attention(q[rows].cpu(), keys, values, scale)
        torch.testing.assert_close(out[rows], expected, atol=tol, rtol=tol)
    return out


def random_contexts(count: int, low: int, high: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    contexts = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [c + 1 if c % BLOCK == 0 else c for c in contexts]  # never a whole number of blocks


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_matches_reference(group, num_splits):
    seed = 10 * group + (num_splits or 0)
    batch = 2 + seed % 4
    contexts = random_contexts(batch, 1, 150, seed)
    backend = TritonAttention(TritonAttentionConfig(decode_block_n=32, num_splits=num_splits))
    check_backend(backend, contexts, [], num_kv_heads=2, group=group, head_dim=64, dtype=torch.float32,
                  seed=seed, tol=1e-5)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_and_chunked_prefill_match_reference(group):
    # A fresh prompt, a later chunk of a prompt with cached context, and a one-token chunk.
    spans = [(0, 37), (45, 23), (30, 1)]
    backend = TritonAttention(TritonAttentionConfig(prefill_block_m=32, prefill_block_n=16))
    check_backend(backend, [], spans, num_kv_heads=2, group=group, head_dim=64, dtype=torch.float32,
                  seed=group, tol=1e-5)


def test_mixed_step_head_dim_128():
    backend = TritonAttention(TritonAttentionConfig(num_splits=2))
    check_backend(backend, random_contexts(3, 20, 100, 7), [(0, 19), (21, 11)], num_kv_heads=1, group=8,
                  head_dim=128, dtype=torch.float32, seed=7, tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_mixed_step(dtype):
    if dtype == torch.bfloat16 and not ON_GPU:
        pytest.skip("the Triton interpreter computes bfloat16 tl.dot wrongly; run on a GPU (benchmarks/gpu/run.sh)")
    backend = TritonAttention(TritonAttentionConfig(num_splits=2))
    check_backend(backend, random_contexts(3, 10, 90, 3), [(0, 21), (33, 9)], num_kv_heads=3, group=3,
                  head_dim=64, dtype=dtype, seed=3, tol=2e-2)


def test_matches_torch_backend_on_the_same_step():
    """Both backends pass the same step: outputs agree and the caches end up identical."""
    contexts = random_contexts(4, 5, 80, 11)
    spans = [(0, 13), (17, 6)]
    q, k, v, kv_cache, metadata, _ = build_step(contexts, spans, 2, 3, 64, torch.float32, seed=11)
    kv_copy = (kv_cache[0].clone(), kv_cache[1].clone())
    triton_out = TritonAttention(TritonAttentionConfig(num_splits=2)).forward(0, q, k, v, kv_cache, metadata, 0.125)
    torch_out = TorchCPUAttention().forward(0, q, k, v, kv_copy, metadata, 0.125)
    torch.testing.assert_close(triton_out, torch_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_cache, kv_copy, rtol=0, atol=0, equal_nan=True)


def test_cache_write_casts_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(0)
    # bf16-representable values: the interpreter's float32 -> bfloat16 cast does not round to
    # nearest like a GPU's, so only exactly representable values copy exactly in both.
    kv = torch.randn(5, 2 * 3 * 64, generator=gen).bfloat16().float()
    k, v = kv[:, : 3 * 64].view(5, 3, 64), kv[:, 3 * 64 :].view(5, 3, 64)  # strided views
    cache = (torch.zeros(64, 3, 64, dtype=torch.bfloat16), torch.zeros(64, 3, 64, dtype=torch.bfloat16))
    cache = (cache[0].to(DEVICE), cache[1].to(DEVICE))
    slots = torch.tensor([40, 3, -1, 17, 63])
    metadata = AttentionMetadata(slots.to(DEVICE), 0, None, None, [])
    q = torch.randn(5, 3, 64, generator=gen)
    TritonAttention().forward(0, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache, metadata, 0.125)
    written = slots >= 0
    expected_k = torch.zeros(64, 3, 64, dtype=torch.bfloat16)
    expected_k[slots[written]] = k[written].bfloat16()
    torch.testing.assert_close(cache[0].cpu(), expected_k, rtol=0, atol=0)
    assert cache[1].cpu()[slots[written]].equal(v[written].bfloat16())


def test_llama_forward_with_triton_backend_matches_torch_backend():
    """A tiny model through prefill then decode: same hidden states with either backend."""
    from tessera.config import ModelConfig
    from tessera.model.llama import LlamaForCausalLM

    config = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=256, tie_word_embeddings=False)
    models = {}
    for name in ("torch", "triton"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config, torch.float32, DEVICE, attn_backend=name)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape) * 0.1 if p.dim() > 1 else torch.ones(p.shape))
        models[name] = (model, model.allocate_kv_cache(8, BLOCK))
    assert isinstance(models["triton"][0].attn_backend, TritonAttention)

    # Step 1: prefill two prompts (lengths 21 and 5) into blocks [3, 1] and [5].
    tables = [[3, 1], [5]]
    lens = [21, 5]
    ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(1))
    slots = [torch.tensor(slots_for_positions(t, 0, n, BLOCK)) for t, n in zip(tables, lens, strict=True)]
    prefill = AttentionMetadata(torch.cat(slots).to(DEVICE), 0, None, None, [
        PrefillSpan(0, 21, 21, slots[0].to(DEVICE)), PrefillSpan(21, 5, 5, slots[1].to(DEVICE))])
    positions = torch.cat([torch.arange(n) for n in lens])
    # Step 2: one decode token each.
    decode_slots = torch.zeros(2, 22, dtype=torch.long)
    decode_slots[0] = torch.tensor(slots_for_positions(tables[0], 0, 22, BLOCK))
    decode_slots[1, :6] = torch.tensor(slots_for_positions(tables[1], 0, 6, BLOCK))
    mask = (torch.arange(22) < torch.tensor([[22], [6]])).view(2, 1, 1, 22)
    new_slots = torch.stack([decode_slots[0, 21], decode_slots[1, 5]])
    decode = AttentionMetadata(new_slots.to(DEVICE), 2, decode_slots.to(DEVICE), mask.to(DEVICE), [])

    hidden = {}
    for name, (model, caches) in models.items():
        first = model(ids.to(DEVICE), positions.to(DEVICE), caches, prefill)
        second = model(torch.tensor([7, 8], device=DEVICE), torch.tensor([21, 5], device=DEVICE), caches, decode)
        hidden[name] = (first.cpu(), second.cpu())
    torch.testing.assert_close(hidden["triton"], hidden["torch"], atol=1e-4, rtol=1e-4)


def test_split_choice():
    cpu = torch.device("cpu")
    assert choose_splits(4, 8, 1000, TritonAttentionConfig(), cpu) == (1, 1024)
    assert choose_splits(4, 8, 1000, TritonAttentionConfig(num_splits=3), cpu) == (3, 384)
    # Never more splits than tiles, and no empty trailing split.
    assert choose_splits(1, 1, 70, TritonAttentionConfig(decode_block_n=32, num_splits=8), cpu) == (3, 32)
    assert choose_splits(1, 1, 65, TritonAttentionConfig(decode_block_n=32, num_splits=2), cpu) == (2, 64)


def test_registry_names_triton_and_auto_picks_it_on_cuda():
    assert isinstance(get_attention_backend("triton"), TritonAttention)
    assert isinstance(get_attention_backend("auto", "cuda"), TritonAttention)
    assert isinstance(get_attention_backend("auto", "cpu"), TorchCPUAttention)


def test_kernels_compile_for_hopper():
    """Compile the kernels for sm_90 with no GPU (Triton bundles ptxas), in a process without the
    interpreter, so a GPU-only compile error fails CI. One variant (bf16, GQA group 4, head_dim
    128: Llama-8B) keeps it short; `compile_for_target(90)` builds them all."""
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from tessera.attention.triton_gpu import compile_for_target; "
            "compile_for_target(90, variants=[('bf16', 4, 128)])")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
