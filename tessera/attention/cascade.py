"""Shared-prefix (cascade) decode attention for the CPU backend.

When every decoding sequence of a step reads the same leading KV blocks (a shared system prompt
revived from the prefix cache), the plain batched decode gathers those blocks' K/V once per
sequence: at batch 32 with a 512-token shared prefix that is 32 copies of the same bytes per
layer, most of the decode attention's time. Here the shared prefix is gathered once, all B * g
query rows of a KV head attend to it in one matmul, each sequence's own suffix goes through the
plain batched path, and one softmax over [prefix scores | suffix scores] makes the result the
same attention as the plain path (the same scores and the same normalization; only the
floating-point summation order differs).
"""

from __future__ import annotations

import torch

# Below this many shared positions the split costs more than the gathers it saves.
MIN_SHARED_TOKENS = 32


def shared_prefix_len(tables: torch.Tensor, context_lens: list[int], block_size: int) -> int:
    """Leading context positions that every decode sequence reads from the same slots.

    tables: [B, max_blocks] block tables (padded with block 0). Equal leading block ids mean
    equal slots; the result is capped at the shortest context (padding is never shared
    context) and is 0 when fewer than two sequences decode or the shared run is too short.
    """
    if tables.shape[0] < 2:
        return 0
    same = (tables == tables[:1]).all(0)
    num_blocks = int(same.int().cumprod(0).sum())
    shared = min(num_blocks * block_size, min(context_lens))
    return shared if shared >= MIN_SHARED_TOKENS else 0


def cascade_decode_attention(grouped_q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                             suffix_k: torch.Tensor, suffix_v: torch.Tensor,
                             suffix_bias: torch.Tensor | None) -> torch.Tensor:
    """Attention of each query row over [shared prefix | its own suffix], float32.

    grouped_q [B, Hkv, g, d] (already scaled); prefix_k/v [Hkv, P, d], read by every sequence;
    suffix_k/v [B, Hkv, S, d]; suffix_bias [B, 1, 1, S] (0 attend, -inf padding) or None.
    Returns [B, Hkv, g, d].
    """
    batch, num_kv_heads, group, head_dim = grouped_q.shape
    prefix_len = prefix_k.shape[1]
    # All B * g query rows of a KV head against the prefix keys at once: [Hkv, B*g, P].
    rows_q = grouped_q.transpose(0, 1).reshape(num_kv_heads, batch * group, head_dim)
    prefix_scores = torch.matmul(rows_q, prefix_k.transpose(-1, -2))
    suffix_scores = torch.matmul(grouped_q, suffix_k.transpose(-1, -2))  # [B, Hkv, g, S]
    if suffix_bias is not None:
        suffix_scores.add_(suffix_bias)
    scores = torch.cat(
        [prefix_scores.view(num_kv_heads, batch, group, prefix_len).transpose(0, 1), suffix_scores], dim=-1)
    probs = torch.softmax(scores, dim=-1)  # one normalization over both parts: exact attention
    prefix_probs = probs[..., :prefix_len].transpose(0, 1).reshape(num_kv_heads, batch * group, prefix_len)
    out = torch.matmul(probs[..., prefix_len:], suffix_v)
    out += torch.matmul(prefix_probs, prefix_v).view(num_kv_heads, batch, group, head_dim).transpose(0, 1)
    return out
