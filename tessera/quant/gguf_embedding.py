"""The token embedding of a GGUF model in gguf mode: rows dequantized on lookup from the blocks.

A tied GGUF model's token_embd is also its lm_head. In gguf mode the lm_head computes from the
file's blocks (a QuantLinear), and `QuantEmbedding` looks tokens up in that same layer, so the
float table (vocab x hidden float32: 113 MiB for SmolLM2-135M) is never kept. Each lookup
dequantizes only its rows, exactly as the layer's `dequantize()` would (tests check both).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.quant.int4 import Int4Linear, packed_layout
from tessera.quant.linear import QuantLinear


def int4_rows(layer: Int4Linear, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an Int4Linear's weight, float32 [len(ids), in_features], read straight from
    its packed layout (see int4.py): (q - 8) * s + z."""
    k, block = layer.in_features, packed_layout()
    flat = layer.packed.view(-1)
    full = layer.padded_rows // block * block if block else 0
    cols = torch.arange(k)
    in_block = ids < full
    # Row r of a 64-row block: byte (r mod 32) of each column's 32 bytes, low nibble for r mod 64 < 32.
    j = ids % block if block else ids
    base = (ids - j) * k // 2
    blk_idx = base[:, None] + cols * (block // 2) + (j % (block // 2))[:, None] if block else None
    # Tail rows (stored in pairs): byte (r - full) // 2 of each column's tail / 2 bytes.
    tail = layer.padded_rows - full
    t = ids - full
    tail_idx = full * k // 2 + cols * (tail // 2) + (t // 2)[:, None] if tail else None
    if blk_idx is None:
        idx, high = tail_idx, (t % 2 == 1)
    elif tail_idx is None:
        idx, high = blk_idx, (j >= block // 2)
    else:
        idx = torch.where(in_block[:, None], blk_idx, tail_idx.clamp(0, flat.numel() - 1))
        high = torch.where(in_block, j >= block // 2, t % 2 == 1)
    byte = flat[idx.clamp(0, flat.numel() - 1)]
    q = torch.where(high[:, None], byte >> 4, byte & 15).float()
    sz = layer.scales_zeros[:, ids].float()  # [groups, rows, 2]
    s = sz[..., 0].t().repeat_interleave(layer.group_size, dim=1)
    z = sz[..., 1].t().repeat_interleave(layer.group_size, dim=1)
    return (q - 8) * s + z


def dequantize_rows(layer: QuantLinear, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of a QuantLinear's weight as float32 [*ids.shape, in_features]."""
    flat = ids.reshape(-1)
    if isinstance(layer, Int4Linear):
        rows = layer.rows(flat)
    elif hasattr(layer, "dequantize_rows"):
        rows = layer.dequantize_rows(flat)
    else:
        raise TypeError(f"{type(layer).__name__} cannot dequantize single rows")
    return rows.reshape(*ids.shape, layer.in_features)


class QuantEmbedding(nn.Module):
    """Embedding lookup into a QuantLinear's rows (vocab x hidden), in the model dtype."""

    def __init__(self, layer: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.dtype = dtype

    @property
    def out_features(self) -> int:
        """Rows of the table (the vocabulary): what the model's weight targets read of any slot."""
        return self.layer.out_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.layer, input_ids).to(self.dtype)

    def extra_repr(self) -> str:
        return f"rows of {self.layer.method}, {self.layer.out_features} x {self.layer.in_features}, {self.dtype}"
