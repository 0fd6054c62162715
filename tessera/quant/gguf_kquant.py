"""GGUF Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights kept as the file's own block bytes, decoded per tile.

`GGUFBlockLinear` holds a tensor's raw blocks (uint8 [rows, bytes per row], exactly the file's
bytes: the memory the file takes, no float copy) and computes x @ W.T by decoding row tiles
into the activation dtype (`tiled_matmul`). The decoders below are torch transcriptions of the
`gguf` package's numpy `dequantize_blocks`, with the same float32 operations in the same order,
so `decode_rows` equals `gguf.quants.dequantize` bit for bit (tests/unit/test_gguf_kquant.py).

Block formats (d, dmin, m float16; QK = 256 weights per K-quant super-block):
- Q5_0, 22 bytes / 32: d, qh (32 high bits, little-endian uint32), qs (16 bytes of low
  nibbles: weight j low, j + 16 high); W = d * (q - 16), q = low | high << 4.
- Q5_1, 24 bytes / 32: d, m, qh, qs; W = d * q + m.
- Q4_K, 144 bytes / 256: d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of
  nibbles (32-weight sub-block 2i in the low nibbles of bytes 32i..32i+31, 2i + 1 in the high);
  W = (d * sc) * q - dmin * mn per sub-block.
- Q5_K, 176 bytes / 256: d, dmin, scales, 32 bytes of high bits (bit i of byte j: sub-block i,
  weight j), 128 bytes of nibbles as Q4_K; W as Q4_K with q = low | high << 4.
- Q6_K, 210 bytes / 256: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales
  (one per 16 weights), d; W = (d * scale) * (q - 32).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from tessera.quant import invariant
from tessera.quant.linear import QuantLinear, tile_rows_for, tiled_matmul

KQUANT_TYPES = (Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> float32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _shifts(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """qh [R, nb, 4] bytes, qs [R, nb, 16] -> 5-bit codes int16 [R, nb, 32]."""
    high = (qh.contiguous().view(torch.int32) >> torch.arange(32, dtype=torch.int32)) & 1  # [R, nb, 32]
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    return low.to(torch.int16) | (high.to(torch.int16) << 4)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """qs [R, nb, 16] bytes -> 4-bit codes [R, nb, 32] (weight j the low nibble of byte j, j + 16 the high)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _decode_q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[..., 0:2]) * (_nibbles32(b[..., 2:18]).float() - 8)


def _decode_q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return d * _nibbles32(b[..., 4:20]).float() + m


def _decode_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2])
    return d * (_q5_codes(b[..., 2:6], b[..., 6:22]) - 16).float()


def _decode_q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return d * _q5_codes(b[..., 4:8], b[..., 8:24]).float() + m


def _k_scale_codes(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 6-bit scale and min of each 32-wide sub-block, uint8 [R, nb, 8] each."""
    s = b[..., 4:16].reshape(*b.shape[:-1], 3, 4)
    lo, mid, top = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: (d * sc, dmin * mn), each float32 [R, nb, 8, 1]."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scale_codes(b)
    return (d * sc.float())[..., None], (dmin * mn.float())[..., None]


def _nibble_subblocks(qs: torch.Tensor) -> torch.Tensor:
    """[R, nb, 128] bytes -> 4-bit codes uint8 [R, nb, 8, 32] (per 32 bytes: low, then high)."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> _shifts(0, 4).view(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def _decode_q4_k(b: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_scales(b)
    return scale * _nibble_subblocks(b[..., 16:144]).float() - offset


def _decode_q5_k(b: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_scales(b)
    qh = b[..., 16:48].reshape(*b.shape[:-1], 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
    q = _nibble_subblocks(b[..., 48:176]) | ((qh & 1) << 4)
    return scale * q.float() - offset


def _q6_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [R, nb, 210] -> 6-bit codes int8 [R, nb, 8, 32] in weight order (q + 32)."""
    lead = b.shape[:-1]
    ql = (b[..., 0:128].reshape(*lead, 2, 1, 64) >> _shifts(0, 4).view(2, 1)) & 0x0F
    qh = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> _shifts(0, 2, 4, 6).view(4, 1)) & 0x03
    return ql.reshape(*lead, 8, 32).to(torch.int8) | (qh.reshape(*lead, 8, 32).to(torch.int8) << 4)


def _decode_q6_k(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    scales = b[..., 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[..., 208:210]) * scales).reshape(*lead, 16, 1)
    return d * (_q6_codes(b) - 32).reshape(*lead, 16, 16).float()


_DECODERS = {Q.Q4_0: _decode_q4_0, Q.Q4_1: _decode_q4_1, Q.Q5_0: _decode_q5_0, Q.Q5_1: _decode_q5_1,
             Q.Q4_K: _decode_q4_k, Q.Q5_K: _decode_q5_k, Q.Q6_K: _decode_q6_k}


def kquant_codes(raw: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A KQUANT_TYPES tensor's block bytes uint8 [rows, bytes per row] -> (codes [rows, K], d, m or None)
    with W = d q + m per sub-block, the decoders' values exactly:
    - Q5_0: int8 q - 16, the file's float16 d [rows, K / 32], no m;
    - Q5_1, Q5_K: int8 q in 0..31, float32 d and m [rows, K / 32] (Q5_K: d sc and -dmin mn);
    - Q4_K: uint8 q in 0..15, float32 d sc and -dmin mn [rows, K / 32];
    - Q6_K: int8 q - 32, float32 d scale [rows, K / 16], no m.
    The float32 scales are products of a float16 and a small integer: exact. For the kernels that take
    a block's codes and scales (gguf_f32_blocks.py, gguf_int8_activations.py)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
    if qtype == Q.Q5_0:
        codes = _q5_codes(b[..., 2:6], b[..., 6:22]) - 16
        return codes.to(torch.int8).reshape(rows, -1), b[..., 0:2].contiguous().view(torch.float16)[..., 0], None
    if qtype == Q.Q5_1:
        codes = _q5_codes(b[..., 4:8], b[..., 8:24]).to(torch.int8).reshape(rows, -1)
        return codes, _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]
    if qtype == Q.Q6_K:
        scale = _f16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()
        return (_q6_codes(b) - 32).reshape(rows, -1), scale.reshape(rows, -1), None
    if qtype not in (Q.Q4_K, Q.Q5_K):
        raise ValueError(f"kquant_codes: {qtype.name} is not one of {', '.join(t.name for t in KQUANT_TYPES)}")
    scale, offset = _k_scales(b)  # [rows, K / 256, 8, 1]
    if qtype == Q.Q4_K:
        codes = _nibble_subblocks(b[..., 16:144])
    else:  # Q5_K: q = low | high << 4
        high = b[..., 16:48].reshape(rows, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
        codes = (_nibble_subblocks(b[..., 48:176]) | ((high & 1) << 4)).to(torch.int8)
    return codes.reshape(rows, -1), scale.reshape(rows, -1), -offset.reshape(rows, -1)


def decode_rows(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Raw block bytes uint8 [R, bytes per row] of a KQUANT_TYPES (or Q4_0 / Q4_1) tensor -> float32 [R, K]."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, nbytes)
    return _DECODERS[qtype](blocks).reshape(rows, blocks.shape[1] * block)


class GGUFBlockLinear(QuantLinear):
    """A GGUF weight of a KQUANT_TYPES block type (or Q4_0 / Q4_1 where the AMX kernel runs:
    gguf_native._decode): on AVX-512 BF16 CPUs its bits in tile order for the invariant kernel; on
    the AVX2 tiles (Zen 3) the Q5 types and K-quants as blocks in panel order for linear_f32_blocks
    (gguf_f32_blocks.py); else kept as its file bytes, decoded per row tile."""

    def __init__(self, raw: torch.Tensor, qtype: Q) -> None:
        block, nbytes = GGML_QUANT_SIZES[qtype]
        if qtype not in _DECODERS:
            raise ValueError(f"no block decoder for GGUF type {qtype.name}; have {', '.join(t.name for t in _DECODERS)}")
        rows, row_bytes = raw.shape
        super().__init__(rows, row_bytes // nbytes * block)
        self.qtype = qtype
        self.method = f"gguf {qtype.name}"
        self.invariant = invariant.enabled(raw.device) and self.in_features % 32 == 0
        self.kernels = ("invariant",) if self.invariant else ("dequant",)
        if self.invariant:  # the blocks' bits in the kernel's tile order are the only copy
            from tessera.quant.gguf_tiles import KQTiles

            tiles = KQTiles.pack(raw, qtype)
            for name in ("codes", "planes", "sup", "sub"):
                self.register_buffer(f"tile_{name}", getattr(tiles, name))
        # On the AVX2 tiles (Zen 3) the weight is kept as its blocks in panel order instead of the
        # file's bytes (gguf_f32_blocks.py: 1.3-1.8x their size), and float32 calls of every size
        # compute from them: the float32 weight's output bits, the file's dequantization rebuilt in
        # registers. Decoding row tiles per call took ~280 ms a Gemma 3 270M token.
        blocks = None
        if not self.invariant and raw.device.type == "cpu":
            from tessera.quant import gguf_f32_blocks

            if qtype in gguf_f32_blocks.FORMAT and gguf_f32_blocks.enabled():
                self.f32_blocks_format = gguf_f32_blocks.FORMAT[qtype]
                blocks = gguf_f32_blocks.blocks_of(raw, qtype, rows, False)
                self.kernels = ("blocks", "dequant")
        self.register_buffer("f32_blocks", blocks)
        if not self.invariant and blocks is None:
            self.register_buffer("raw", raw.contiguous())

    @property
    def tiles(self):
        from tessera.quant.gguf_tiles import KQTiles

        return KQTiles(self.tile_codes, self.tile_planes, self.tile_sup, self.tile_sub)

    @classmethod
    def from_gguf(cls, data: np.ndarray, qtype: Q, rows: int) -> GGUFBlockLinear:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
        return cls(torch.from_numpy(raw.copy()), qtype)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, float32 [len(ids), K], from the copy this layer keeps (not the tiles)."""
        if self.f32_blocks is not None:
            from tessera.quant.gguf_f32_blocks import weight_rows

            return weight_rows(self.f32_blocks, self.f32_blocks_format, ids)
        return decode_rows(self.raw[ids], self.qtype)

    def _fill(self, start: int, end: int, tile: torch.Tensor) -> None:
        tile.copy_(self._rows(torch.arange(start, end)))

    def dequantize(self) -> torch.Tensor:
        if self.invariant:
            return self.tiles.rows(torch.arange(self.out_features), self.in_features, self.qtype)
        return self._rows(torch.arange(self.out_features))

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.tiles.rows(flat, self.in_features, self.qtype) if self.invariant else \
            self._rows(flat)
        return rows.reshape(*ids.shape, self.in_features)

    def select_kernel(self, num_rows: int) -> str:
        return self.kernels[0]

    def logits_argmax(self, x: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.tiles.logits_argmax(x, self.qtype, self.out_features, logits) if self.invariant else None

    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == "invariant" and self.invariant:
            return self._invariant_matmul(x)
        if kernel == "blocks" and self.f32_blocks is not None and x.dtype == torch.float32:
            from tessera import kernels

            return kernels.ops().linear_f32_blocks(x.contiguous(), self.f32_blocks, None, self.out_features,
                                                   self.f32_blocks_format, 0)
        if kernel == "blocks":  # other activation dtypes: the weight decoded per tile
            kernel = "dequant"
        if kernel != "dequant":
            raise ValueError(f"unknown {self.method} kernel {kernel!r}; have {self.kernels}")
        # A decode tile is built from several temporaries per element: keep tiles a quarter size.
        return tiled_matmul(x, self.out_features, max(1, tile_rows_for(self.in_features) // 4), self._fill)

    def _invariant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Batch-invariant: every tile decoded from its codes in registers, rounded to bf16 (with a
        bf16 remainder for float32 activations) and multiplied on AMX tiles or with AVX-512 BF16
        dot products (invariant.py, gguf_tiles.py);
        each output column is reduced over K in one fixed order whatever M is."""
        return self.tiles.matmul(x, self.qtype, self.out_features)
