"""GGUF weights on int8 activations, for x86 CPUs without AMX (Zen 3, Zen 4).

The arithmetic llama.cpp and vLLM's GGUF kernels use: each row of x is quantized per 32 to int8
(d_x = amax / 127, round to nearest even: llama.cpp's Q8_1) and the code products are summed in
integers; per block W.x = d d_x sum q q_x (+ m s_x for W = d q + m: Q4_1, and Q4_0 with m = -8 d,
exact in float16; s_x = d_x sum q_x). The kernels (tessera_gemv.q4x8 and q8x8,
quant/csrc/gemv_x8.h, in both builds of tessera_gemv) take the codes in groups of 8 rows
interleaved so that one vector lane holds one row (their layout comments say how); `pack_q4x8` /
`pack_q8x8` write those layouts from the file's blocks and the `unpack_*` functions read them back.

Every block type maps onto the two kernels exactly, with its scales as float16 (the file's own) or
float32 (products d * sc of a float16 and a small integer, exact in float32):
- Q4_0, Q4_1: q4x8, W = d q + m per 32 (float16 d, m);
- Q4_K: q4x8, W = (d sc) q - dmin mn per 32-weight sub-block (float32);
- Q8_0: q8x8, W = d q per 32 (float16);
- Q5_0: q8x8 with the 5-bit codes less 16 as int8, W = d (q - 16) per 32 (float16): 8.5 bits a weight
  where the file has 5.5, for one kernel that reads them at the memory's rate;
- Q6_K: q8x8 with the 6-bit codes less 32, W = (d scale) (q - 32) per 16 (float32).

Against x @ dequantize().T the kernels add the activation rounding: at most d_x / 2 per element,
about 2^-8 of a block's largest activation. Every row count takes the same kernel and a row's
result depends only on that row, so the layers are batch-invariant.
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.quant import native_gemv
from tessera.quant.linear import QuantLinear, tile_rows_for, tiled_matmul

BLOCK = 32
GROUP = 8  # weight rows interleaved per group


def decode_q4_blocks(blocks: np.ndarray, qtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 (18-byte) or Q4_1 (20-byte) blocks uint8 [rows, K / 32, bytes] -> (codes uint8 [rows, K] in
    0..15, d, m float16 [rows, K / 32]); W = d q + m."""
    from gguf import GGMLQuantizationType as Q

    rows = blocks.shape[0]
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].copy())
    if qtype == Q.Q4_1:
        m = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].copy())
        codes = blocks[..., 4:]
    else:  # d (q - 8) = d q - 8 d; times 8 is exact in float16 unless it overflows
        m, codes = -8 * d, blocks[..., 2:]
        if not torch.isfinite(m).all():
            raise ValueError("a Q4_0 block scale overflows float16 once multiplied by 8")
    return file_codes(torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1).copy())), d, m


def file_codes(qs: torch.Tensor) -> torch.Tensor:
    """The file's packed codes [N, K / 2] (byte j of a block: weight j low, j + 16 high) -> [N, K]."""
    b = qs.view(qs.shape[0], -1, BLOCK // 2)
    return torch.cat([b & 15, b >> 4], dim=-1).view(qs.shape[0], -1)


def pack_q4x8(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
              scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    """codes uint8 [N, K] in 0..15, d and m [N, K / 32] -> the kernel's (qs [G, K / 32, 128], d, m
    [G, K / 32, 8] in scale_dtype), G = ceil(N / 8); padding rows are zero codes and scales."""
    n, k = codes.shape
    pad = -n % GROUP
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        d, m = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (d, m))
    g, nb = (n + pad) // GROUP, k // BLOCK
    # [group, row i, block, vector j, nibble h, t] -> [group, block, j, i, t, h]
    c = codes.view(g, GROUP, nb, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    qs = (c[..., 0] | (c[..., 1] << 4)).contiguous().view(g, nb, 128)

    return qs, _group_scales(d, g, scale_dtype), _group_scales(m, g, scale_dtype)


def _group_scales(t: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-row scales [8 G, S] -> the kernels' [G, S, 8] (a group's 8 rows together) in `dtype`."""
    return t.to(dtype).view(groups, GROUP, t.shape[1]).transpose(1, 2).contiguous()


def pack_q8x8(codes: torch.Tensor, d: torch.Tensor,
              scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K], d [N, K / 32] (a scale per 32) or [N, K / 16] (per 16) -> the kernel's
    (qs uint8 [G, K / 32, 256], d [G, K / 32 or K / 16, 8] in scale_dtype); padding rows are zero."""
    n, k = codes.shape
    if d.shape[1] not in (k // BLOCK, 2 * k // BLOCK):
        raise ValueError(f"pack_q8x8: {d.shape[1]} scales a row for {k} weights; one per 32 or per 16")
    pad = -n % GROUP
    if pad:
        codes, d = torch.cat([codes, codes.new_zeros(pad, k)]), torch.cat([d, d.new_zeros(pad, d.shape[1])])
    g, nb = (n + pad) // GROUP, k // BLOCK
    # [group, row i, block, vector j, t] -> [group, block, j, i, t]
    qs = codes.view(torch.uint8).view(g, GROUP, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(g, nb, 256)
    return qs, _group_scales(d, g, scale_dtype)


def unpack_q8x8(qs: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_q8x8's codes: [G, K / 32, 256] -> int8 [8 G, K]."""
    g, nb = qs.shape[:2]
    return qs.view(g, nb, 8, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(g * GROUP, nb * BLOCK).view(torch.int8)


def unpack_q4x8(qs: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_q4x8's codes: [G, K / 32, 128] -> uint8 [8 G, K]."""
    g, nb = qs.shape[:2]
    v = qs.view(g, nb, 4, GROUP, 4)
    c = torch.stack([v & 15, v >> 4], dim=-1)  # [group, block, j, i, t, h]
    return c.permute(0, 3, 1, 2, 5, 4).reshape(g * GROUP, nb * BLOCK)


def _row_scales(t: torch.Tensor) -> torch.Tensor:
    """Scales in group order [G, K / 32, 8] -> float32 per row [8 G, K / 32]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1]).float()


class _Int8ActivationLinear(QuantLinear):
    """Kernels: "native" (the int8-activation kernel, any row count) and "dequant" (float tiles of
    the file's dequantized weight: the reference)."""

    @property
    def kernels(self) -> tuple[str, ...]:
        return (("native",) if native_gemv.available() else ()) + ("dequant",)

    def native_ok(self) -> bool:
        return self.qs.device.type == "cpu" and "native" in self.kernels

    def _groups(self, g: torch.Tensor | slice) -> torch.Tensor:
        """The weight of groups `g` (an index tensor or a slice) as float32 [8 * groups, K]."""
        raise NotImplementedError

    def _fill(self, start: int, end: int, tile: torch.Tensor) -> None:
        g0 = start // GROUP  # each group unpacked once, not once per row
        tile.copy_(self._groups(slice(g0, -(-end // GROUP)))[start - GROUP * g0 : end - GROUP * g0])

    def dequantize(self) -> torch.Tensor:
        return self._groups(slice(None))[: self.out_features]

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as float32 [*ids.shape, in_features], exactly as dequantize()."""
        flat = ids.reshape(-1)
        if self.native_ok():  # one op (a decode step's lookup), the same values
            return self._native_rows(flat.long().contiguous()).view(*ids.shape, self.in_features)
        return self._rows(flat // GROUP, flat % GROUP).view(*ids.shape, self.in_features)

    def _rows(self, g: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        """Row i of group g for each pair, as float32 [len(g), K]: an embedding lookup gathers only
        its rows' bytes (unpacking their whole groups cost ~0.1 ms a decode step)."""
        raise NotImplementedError

    def _native_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """_rows for int64 row ids, by the native kernel."""
        raise NotImplementedError

    def select_kernel(self, num_rows: int) -> str:
        return "native" if self.native_ok() else "dequant"

    def logits_argmax(self, x: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """bf16 x [M, K] -> (forward(x).float(), each row's first maximum of it) in one call, the ids
        found as the kernel rounds its output (greedy sampling reads no logits); without `logits` the
        first is [M, 0]. None where padding rows would join the race (out_features not a multiple of 8)."""
        if not self.native_ok() or self.out_features % GROUP:
            return None
        return self._native_logits(x.contiguous(), logits)

    def _native_logits(self, x: torch.Tensor, logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == "native":
            y = self._native(x)
            return y[:, : self.out_features] if y.shape[1] > self.out_features else y
        if kernel != "dequant":
            raise ValueError(f"unknown {self.method or type(self).__name__} kernel {kernel!r}; have {self.kernels}")
        return tiled_matmul(x, self.out_features, tile_rows_for(self.in_features), self._fill)


class Q4BlocksLinear(_Int8ActivationLinear):
    """A GGUF Q4_0, Q4_1 or Q4_K weight in the q4x8 layout: W = d q + m per 32."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 scale_dtype: torch.dtype = torch.float16) -> None:
        """codes uint8 [N, K] in 0..15; d, m [N, K / 32], exact in scale_dtype (float16: Q4_0 / Q4_1's
        own; float32: Q4_K's d sc and -dmin mn)."""
        super().__init__(*codes.shape)
        packed, dp, mp = pack_q4x8(codes, d, m, scale_dtype)
        self.register_buffer("qs", packed)
        self.register_buffer("d", dp)
        self.register_buffer("m", mp)

    def _groups(self, g: torch.Tensor | slice) -> torch.Tensor:
        q = unpack_q4x8(self.qs[g]).float()
        rows = q.shape[0]
        d, m = (_row_scales(t[g]) for t in (self.d, self.m))
        return (q.view(rows, -1, BLOCK) * d[..., None] + m[..., None]).view(rows, -1)

    def _rows(self, g: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        # byte 4 i + t of vector j: row i's codes at 8 j + t (low nibble) and 8 j + 4 + t (high)
        v = self.qs.view(self.qs.shape[0], -1, 4, GROUP, 4)[g, :, :, i]  # [R, blocks, j, t]
        q = torch.stack([v & 15, v >> 4], dim=3).view(len(g), -1, BLOCK).float()
        d, m = (t[g, :, i].float()[..., None] for t in (self.d, self.m))
        return (q * d + m).view(len(g), -1)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return native_gemv.gemv_q4x8(x, self.qs, self.d, self.m)

    def _native_logits(self, x: torch.Tensor, logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.tessera_gemv.q4x8_logits(x, self.qs, self.d, self.m, True, logits)

    def _native_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.tessera_gemv.q4x8_rows(self.qs, self.d, self.m, ids)


class Q8BlocksLinear(_Int8ActivationLinear):
    """A GGUF Q8_0, Q5_0 or Q6_K weight in the q8x8 layout: W = d q, a scale per 32 or per 16."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, scale_dtype: torch.dtype = torch.float16) -> None:
        """codes: int8 [N, K]; d: [N, K / 32] or [N, K / 16], exact in scale_dtype (float16: the
        file's own scales; float32: Q6_K's d * scale)."""
        super().__init__(*codes.shape)
        packed, dp = pack_q8x8(codes, d, scale_dtype)
        self.register_buffer("qs", packed)
        self.register_buffer("d", dp)

    def _groups(self, g: torch.Tensor | slice) -> torch.Tensor:
        q = unpack_q8x8(self.qs[g]).float()
        rows, per = q.shape[0], self.in_features // self.d.shape[1]
        return (q.view(rows, -1, per) * _row_scales(self.d[g])[..., None]).view(rows, -1)

    def _rows(self, g: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        # byte 4 i + t of vector j: row i's code at 4 j + t
        q = self.qs.view(self.qs.shape[0], -1, 8, GROUP, 4)[g, :, :, i].reshape(len(g), -1).view(torch.int8)
        d = self.d[g, :, i].float()  # [R, K / 32 or K / 16]
        return (q.float().view(len(g), d.shape[1], -1) * d[..., None]).view(len(g), -1)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return native_gemv.gemv_q8x8(x, self.qs, self.d)

    def _native_logits(self, x: torch.Tensor, logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.tessera_gemv.q8x8_logits(x, self.qs, self.d, True, logits)

    def _native_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.tessera_gemv.q8x8_rows(self.qs, self.d, ids)


def kquant_parts(raw: torch.Tensor, qtype) -> tuple | None:
    """A Q5_0, Q4_K or Q6_K tensor's block bytes uint8 [N, bytes per row] as the parts of a layer on
    int8 activations: ("q8_blocks", codes, d), ("q8_blocks16", codes, d) or ("q4_codes", codes, d, m)
    (gguf_native._layer builds it); None for another type. The codes and scales are
    gguf_kquant.kquant_codes', whose weights equal the `gguf` package's dequantization bit for bit."""
    from gguf import GGMLQuantizationType as Q

    from tessera.quant.gguf_kquant import kquant_codes

    if qtype not in (Q.Q5_0, Q.Q4_K, Q.Q6_K):
        return None
    codes, d, m = kquant_codes(raw, qtype)
    if qtype == Q.Q5_0:  # W = d (q - 16): int8 codes in -16..15, the file's float16 d
        return "q8_blocks", codes, d
    if qtype == Q.Q4_K:  # W = (d sc) q - dmin mn per 32: q4x8 with float32 d and m
        return "q4_codes", codes, d, m
    return "q8_blocks16", codes, d  # Q6_K: W = (d scale) (q - 32) per 16
