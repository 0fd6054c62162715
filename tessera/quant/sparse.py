"""2:4 structured sparsity (--sparsity 2:4): in each run of 4 weights along a row, keep the 2 of
largest magnitude and zero the other 2, at load time.

What it buys on this machine: memory only, and only when stored compressed. PyTorch's
semi-structured sparse kernels (`to_sparse_semi_structured`) need a CUDA GPU with sparse tensor
cores; on a CPU a sparse matmul is no faster than the dense one, so there is no speed-up here
and none is claimed. With --quantization none the pruned weight is kept compressed
(`Sparse24Linear`): the 2 kept values of each group in the weight dtype, plus their positions as
two 2-bit indices (4 bits a group), and it is decompressed a row tile at a time into a scratch
buffer for each call, like the dequantizing kernels (tessera/quant/linear.py `tiled_matmul`).
float32: 2 + 1/8 bytes per weight instead of 4 (0.53x). With int8, int4 or w8a8 the pruned float
weight is quantized as usual and stored dense: the zeros cost as much as any other code, so
nothing is saved (int8 and w8a8 keep them exactly zero; int4's zero point generally does not).
"""

from __future__ import annotations

import logging

import torch

from tessera.quant.linear import QuantLinear, tile_rows_for, tiled_matmul

logger = logging.getLogger("tessera")

GROUP = 4  # weights per group
KEEP = 2  # kept per group


def prune_2_4(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] with K % 4 == 0 -> a copy with the 2 smallest-magnitude weights of each
    group of 4 consecutive weights of a row set to zero (ties: the earlier weight is kept)."""
    _check_shape(weight, GROUP)
    idx = _kept_indices(weight)
    groups = weight.reshape(weight.shape[0], -1, GROUP)
    return torch.zeros_like(groups).scatter_(2, idx, groups.gather(2, idx)).view_as(weight)


def _check_shape(weight: torch.Tensor, multiple: int) -> None:
    if weight.dim() != 2 or weight.shape[1] % multiple:
        raise ValueError(f"2:4 sparsity needs a 2-D weight whose rows are a multiple of {multiple} long, got "
                         f"{tuple(weight.shape)}; run without --sparsity 2:4")


def _kept_indices(weight: torch.Tensor) -> torch.Tensor:
    """[N, K/4, 2] int64 positions (0..3, ascending) of the kept weights of each group."""
    groups = weight.reshape(weight.shape[0], -1, GROUP).abs().float()
    # A stable descending sort keeps the earlier of two equal magnitudes (topk's choice is unspecified).
    order = torch.sort(groups, dim=2, descending=True, stable=True).indices[..., :KEEP]
    return order.sort(dim=2).values


class Sparse24Linear(QuantLinear):
    """A 2:4-pruned weight stored compressed: kept values [N, K/2] and packed 2-bit indices
    [N, K/8] bytes (each byte: two groups, each group's two positions as i0 | i1 << 2)."""

    method = "2:4 sparse"
    kernels = ("decompress",)

    def __init__(self, values: torch.Tensor, packed_indices: torch.Tensor, in_features: int) -> None:
        super().__init__(values.shape[0], in_features)
        self.register_buffer("values", values.contiguous())
        self.register_buffer("indices", packed_indices.contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Sparse24Linear:
        _check_shape(weight, 2 * GROUP)  # two groups per index byte
        n, k = weight.shape
        idx = _kept_indices(weight)  # [N, K/4, 2]
        values = weight.reshape(n, -1, GROUP).gather(2, idx).reshape(n, k // 2)
        codes = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.uint8).view(n, -1, 2)  # [N, K/8, 2] 4-bit codes
        return cls(values, codes[..., 0] | (codes[..., 1] << 4), k)

    def _kept(self, start: int, end: int) -> torch.Tensor:
        """[rows, K/4, 2] int64 positions of rows start..end-1's kept values."""
        b = self.indices[start:end]
        codes = torch.stack([b & 15, b >> 4], dim=2).view(end - start, -1)  # [rows, K/4]
        return torch.stack([codes & 3, codes >> 2], dim=2).long()

    def _fill(self, start: int, end: int, tile: torch.Tensor) -> None:
        rows = end - start
        values = self.values[start:end].view(rows, -1, KEEP).to(tile.dtype)
        tile.zero_().view(rows, -1, GROUP).scatter_(2, self._kept(start, end), values)

    def dequantize(self) -> torch.Tensor:
        w = torch.empty(self.out_features, self.in_features)
        self._fill(0, self.out_features, w)
        return w

    def select_kernel(self, num_rows: int) -> str:
        return "decompress"

    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel != "decompress":
            raise ValueError(f"unknown 2:4 kernel {kernel!r}; have {self.kernels}")
        return tiled_matmul(x, self.out_features, tile_rows_for(self.in_features), self._fill)
