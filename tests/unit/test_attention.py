"""The torch attention backend vs a naive per-sequence softmax(QK^T)V reference.

Sequences have random lengths (not multiples of the block size), shuffled blocks, and a cache
whose unwritten slots hold NaN, so a wrong gather index or a missing mask shows up.
"""

from __future__ import annotations

import pytest
import torch

from tessera.attention.backend import AttentionBackend, get_attention_backend
from tessera.attention.metadata import AttentionMetadata, PrefillSpan, slots_for_positions
from tessera.attention.torch_cpu import TorchCPUAttention

BLOCK = 16
NUM_KV_HEADS = 2


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, d] are the last n positions of a sequence whose K/V are k, v [m, Hkv, d]."""
    n, num_heads, head_dim = q.shape
    m = k.shape[0]
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    causal = torch.arange(m).view(1, -1) <= torch.arange(n).view(-1, 1) + (m - n)
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return torch.einsum("hnm,mhd->nhd", probs, v).reshape(n, num_heads * head_dim)


def build_step(composition: str, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """A random step: returns (q, k, v, cache, metadata, per-sequence reference inputs)."""
    gen = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    num_decodes = {"decode": 4, "prefill": 0, "mixed": 3}[composition]
    # Prefill spans: (tokens already cached, new tokens); a fresh prompt and a later chunk.
    spans = {"decode": [], "prefill": [(0, 37), (21, 11)], "mixed": [(0, 19), (45, 7)]}[composition]
    seqs = [(randint(1, 70), 1) for _ in range(num_decodes)] + spans
    num_blocks = 1 + sum(-(-(cached + new) // BLOCK) for cached, new in seqs) + 3
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: padding only

    shape = (num_blocks * BLOCK, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_cache[:BLOCK] = 1e3 * torch.randn(BLOCK, NUM_KV_HEADS, head_dim, generator=gen)
    v_cache[:BLOCK] = 1e3 * torch.randn(BLOCK, NUM_KV_HEADS, head_dim, generator=gen)

    num_tokens = sum(new for _, new in seqs)
    # q, k, v as strided views of one projection output, like the model passes them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + NUM_KV_HEADS) * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    v = qkv[:, (num_heads + NUM_KV_HEADS) * head_dim :].view(num_tokens, NUM_KV_HEADS, head_dim)

    slot_mapping, references, prefills = [], [], []
    max_context = max((cached + 1 for cached, _ in seqs[:num_decodes]), default=0) + 5  # extra padding
    decode_slots = torch.zeros(num_decodes, max_context, dtype=torch.long)
    decode_mask = torch.zeros(num_decodes, 1, 1, max_context, dtype=torch.bool)
    token = 0
    for i, (cached, new) in enumerate(seqs):
        n_blocks = -(-(cached + new) // BLOCK)
        table, free = free[:n_blocks], free[n_blocks:]
        slots = torch.tensor(slots_for_positions(table, 0, cached + new, BLOCK))
        history_k = torch.randn(cached, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        history_v = torch.randn(cached, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        k_cache[slots[:cached]] = history_k
        v_cache[slots[:cached]] = history_v
        slot_mapping.append(slots[cached:])
        rows = slice(token, token + new)
        references.append((rows, torch.cat([history_k, k[rows]]), torch.cat([history_v, v[rows]])))
        if i < num_decodes:
            decode_slots[i, : cached + 1] = slots
            decode_mask[i, ..., : cached + 1] = True
        else:
            prefills.append(PrefillSpan(token, new, cached + new, slots))
        token += new

    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping),
        num_decode_tokens=num_decodes,
        decode_slots=decode_slots if num_decodes else None,
        decode_mask=decode_mask if num_decodes else None,
        prefills=prefills,
    )
    return q, k, v, (k_cache, v_cache), metadata, references


@pytest.mark.parametrize("composition", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_naive_reference(composition, group, head_dim, dtype):
    num_heads = NUM_KV_HEADS * group
    q, k, v, kv_cache, metadata, references = build_step(composition, num_heads, head_dim, dtype, seed=group * head_dim)
    scale = head_dim**-0.5
    backend = TorchCPUAttention()
    backend.begin_step(metadata)
    out = backend.forward(0, q, k, v, kv_cache, metadata, scale)

    assert out.shape == (q.shape[0], num_heads * head_dim) and out.dtype == dtype
    torch.testing.assert_close(kv_cache[0][metadata.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(kv_cache[1][metadata.slot_mapping], v, rtol=0, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows, keys, values in references:
        expected = naive_attention(q[rows], keys, values, scale)
        torch.testing.assert_close(out[rows].float(), expected, atol=tol, rtol=tol)


def test_layers_reuse_plan_and_a_new_step_rebuilds_it():
    q, k, v, kv_cache, metadata, references = build_step("mixed", 6, 64, torch.float32, seed=1)
    backend = TorchCPUAttention()
    backend.begin_step(metadata)
    first = backend.forward(0, q, k, v, kv_cache, metadata, 0.125)
    plan = backend._plan
    second = backend.forward(1, q, k, v, kv_cache, metadata, 0.125)
    assert backend._plan is plan  # derived once per step, not per layer
    torch.testing.assert_close(first, second, rtol=0, atol=0)

    q2, k2, v2, kv2, md2, refs2 = build_step("decode", 6, 64, torch.float32, seed=2)
    out = backend.forward(0, q2, k2, v2, kv2, md2, 0.125)  # no begin_step: still rebuilt
    for rows, keys, values in refs2:
        torch.testing.assert_close(out[rows], naive_attention(q2[rows], keys, values, 0.125), atol=1e-5, rtol=1e-5)


def test_registry():
    assert isinstance(get_attention_backend(), TorchCPUAttention)
    assert isinstance(get_attention_backend("torch"), AttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch"):
        get_attention_backend("flash")


def test_decode_tables_metadata_makes_the_dense_decode_tensors_on_first_read():
    """The runner's DecodeTablesMetadata gives the torch backends decode_slots / decode_mask as they
    were built eagerly: each decode's context slots from its block table (padding rows point at
    block 0), True up to its context length."""
    from tessera.attention.metadata import DecodeTablesMetadata

    bs, tables, lens = 4, [[3, 1, 7], [2], [5, 6]], [9, 3, 5]
    padded = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    m = DecodeTablesMetadata(slot_mapping=torch.tensor([0, 0, 0]), num_decode_tokens=3, decode_slots=None,
                             decode_mask=None, prefills=[], block_size=bs, decode_block_tables=padded,
                             decode_context_lens=torch.tensor(lens))
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        want = slots_for_positions(table, 0, n, bs)
        assert m.decode_slots[i, :n].tolist() == want
        assert m.decode_mask[i, 0, 0].tolist() == [True] * n + [False] * (max(lens) - n)
    assert m.decode_slots.shape == (3, max(lens)) and (m.decode_slots[1, 4:] < bs).all()  # padding: block 0
    m.decode_slots = torch.zeros(3, 1, dtype=torch.long)  # a reader's own tensor stays
    assert m.decode_slots.shape == (3, 1)
