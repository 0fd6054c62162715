"""Packed token bitmasks: allocation, and applying one to a batch of logits in one operation.

A mask row holds ceil(V/32) int32 words; bit j of word w (little-endian) allows token 32 w + j.
Applying it unpacks through a 256 x 8 table of {0, -inf} (one byte of the mask -> the additive
mask of its 8 tokens) with one embedding lookup and one add over the constrained rows: no
Python loop over rows or tokens. On this project's CPUs that was about 2.5x faster than
xgrammar's own CPU kernel and 6x faster than shifting bits in torch (see docs/structured-outputs.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ALL_ALLOWED = -1  # an int32 word with every bit set

_LUTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


@dataclass
class TokenMask:
    """The packed mask of one step: bitmask[i] applies to logits row rows[i] (rows None: all)."""

    bitmask: torch.Tensor  # int32 [R, ceil(V/32)]
    rows: torch.Tensor | None


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A [rows, ceil(V/32)] int32 CPU mask with every token allowed."""
    return torch.full((rows, bitmask_width(vocab_size)), ALL_ALLOWED, dtype=torch.int32)


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    if key not in _LUTS:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        _LUTS[key] = torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)
    return _LUTS[key]


def additive_mask(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[R, vocab_size] of 0 (allowed) and -inf (not) from a packed [R, W] mask."""
    rows = bitmask.shape[0]
    byte_ids = bitmask.to(device, non_blocking=True).contiguous().view(torch.uint8).view(rows, -1).int()
    return F.embedding(byte_ids, _byte_table(device, dtype)).view(rows, -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of `logits` [B, V] with the disallowed tokens at -inf.

    bitmask [R, W] masks logits rows `rows` (an int64 tensor of R row indices), or all B rows
    when rows is None (then R == B). `logits` itself is never written.
    """
    vocab = logits.shape[-1]
    if rows is None:
        return logits + additive_mask(bitmask, vocab, logits.dtype, logits.device)
    rows = rows.to(logits.device)
    masked = logits[rows] + additive_mask(bitmask, vocab, logits.dtype, logits.device)
    return logits.index_put((rows,), masked)
