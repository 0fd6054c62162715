"""Triton kernels for paged attention: KV-cache write, split-K decode, prefill over the cache.

Layout (see `tessera.attention.metadata`): each layer's cache is `[num_slots, Hkv, d]`; a
sequence's position p lives in slot `slots[p]`. The kernels read K/V row by row through those
slot indices, never through a gathered contiguous copy.

GQA: a program owns one KV head and all `GROUP = H // Hkv` query heads that share it, so each
K/V tile is loaded once for the whole group. Query rows are (token, head-in-group) pairs laid
out as `row = token * BLOCK_G + g` (BLOCK_G is GROUP rounded up to a power of two; padded rows
are masked). tl.dot needs at least 16 rows, so decode pads the group to 16.

Softmax runs online in base 2 (`qk_scale = scale * log2(e)`, exp2), accumulates in float32,
and dot inputs are cast to the cache dtype (bf16/fp16 on a GPU: tensor cores). A float32
cache uses IEEE dots, not TF32, so fp32 results match a float32 reference.

Importing this module decorates the kernels: set TRITON_INTERPRET=1 before the first import of
triton to run them on CPU tensors (tests do).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: k/v[t] (all KV heads) -> cache[slot_mapping[t]]; slot < 0 is skipped."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & (slot >= 0)
    cache_off = slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, slots_ptr, kv_head, n0, kv_end, query_pos,
    qk_scale, stride_cache_slot, stride_cache_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold KV positions n0 .. n0+BLOCK_N-1 (with BOUNDED, those < kv_end; with CAUSAL, also
    those <= the row's query_pos) into the online-softmax state (acc, m_i, l_i) of q's rows.
    CAUSAL requires BOUNDED."""
    pos = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    if BOUNDED:
        in_range = pos < kv_end
        slots = tl.load(slots_ptr + pos, mask=in_range, other=0).to(tl.int64)
        kv_mask = in_range[:, None] & (dims[None, :] < HEAD_DIM)
    else:
        slots = tl.load(slots_ptr + pos).to(tl.int64)
        kv_mask = (pos[:, None] >= 0) & (dims[None, :] < HEAD_DIM)
    kv_off = slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + dims[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N]
    if CAUSAL:
        s = tl.where((pos[None, :] <= query_pos[:, None]) & in_range[None, :], s, float("-inf"))
    elif BOUNDED:
        s = tl.where(in_range[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def paged_decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, context_lens_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, tokens_per_split,
    stride_qb, stride_qh, stride_cache_slot, stride_cache_head, stride_slots_b,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (batch, kv_head, split). One decode query per sequence; the program covers context
    positions [split * tokens_per_split, +tokens_per_split) of its sequence, for all GROUP query
    heads of its KV head, and writes a normalised partial output and its log2-sum-exp to
    part_out [B, H, S, d] / part_lse [B, H, S] (an empty split writes 0 and -inf)."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * GROUP
    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    row_mask = g < GROUP
    q_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    seq_slots = slots_ptr + seq * stride_slots_b
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, seq_slots, kv_head, n0, end, g,
            qk_scale, stride_cache_slot, stride_cache_head,
            HEAD_DIM, BLOCK_D, BLOCK_N, False, True, DOT_PRECISION,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    part_row = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G]
    tl.store(part_lse_ptr + part_row, lse, mask=row_mask)
    tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], out, mask=q_mask)


@triton.jit
def reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_out_b,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Grid (batch, head): merge the S partial outputs of one query head by their weights
    exp2(lse_s - max lse), and write the result in the output dtype to out[b, head * d]."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    row = (seq * num_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + row, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
                   mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(weights, axis=0)
    out = tl.sum(part * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_b + head * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, context_slots_ptr,
    tile_span_ptr, tile_first_ptr, span_query_start_ptr, span_query_len_ptr, span_context_len_ptr,
    span_slots_start_ptr,
    qk_scale, stride_qt, stride_qh, stride_cache_slot, stride_cache_head, stride_out_t,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (tile, kv_head). A tile is BLOCK_Q consecutive new tokens of one prefill span (its
    index and first token come from tile_span/tile_first); the program computes their
    attention for the GROUP query heads of its KV head over the span's cached context, causal
    with the offset context_len - query_len. Context slots of span i are
    context_slots[span_slots_start[i] : + context_len]."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    span = tl.load(tile_span_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    query_start = tl.load(span_query_start_ptr + span).to(tl.int64)
    query_len = tl.load(span_query_len_ptr + span)
    context_len = tl.load(span_context_len_ptr + span)
    slots = context_slots_ptr + tl.load(span_slots_start_ptr + span).to(tl.int64)
    offset = context_len - query_len

    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    token = first + rows // BLOCK_G  # index in the span's new tokens
    g = rows % BLOCK_G
    heads = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    row_mask = (token < query_len) & (g < GROUP)
    io_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + (query_start + token)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)
    query_pos = offset + token

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    # Positions before the tile's first query are visible to every row: no mask needed there.
    unmasked_end = ((offset + first) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(offset + first + BLOCK_Q, context_len)
    for n0 in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, slots, kv_head, n0, kv_end, query_pos,
            qk_scale, stride_cache_slot, stride_cache_head,
            HEAD_DIM, BLOCK_D, BLOCK_N, False, False, DOT_PRECISION,
        )
    for n0 in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, slots, kv_head, n0, kv_end, query_pos,
            qk_scale, stride_cache_slot, stride_cache_head,
            HEAD_DIM, BLOCK_D, BLOCK_N, True, True, DOT_PRECISION,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (query_start + token)[:, None] * stride_out_t + heads[:, None] * HEAD_DIM + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)
