"""GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks in the AMX kernel's tile order (the "KQ" format).

The batch-invariant kernel (csrc/invariant_qgemm.cpp, `kqgemm`) reads a weight per B tile: 16
output columns x 32 k. A file's blocks run along a row instead, so at load their bits are moved
(none added, none lost) into that order, and the kernel decodes each tile in registers:
- `codes`: the low 4 bits of every code, as `invariant.pack_nibbles`;
- `planes`: int32 [Nb, Kb, 16, P], bit i of plane p = bit 4 + p of value i of a 32-value k-pair
  row (P = 1 for the 5-bit types, 2 for Q6_K, 0 for Q4_0, Q4_1 and Q4_K);
- `sup`: float16 [Nb, S, F, 16], the super-block's d and dmin (Q4_K, Q5_K), d and m (Q4_1, Q5_1) or
  d alone (Q4_0, Q5_0, Q6_K: F = 1) per column, S super-blocks over K;
- `sub`: 1 byte [Nb, Kb, 2, 16], per 32-wide K step: the 6-bit scale and min (Q4_K, Q5_K) or the
  two int8 scales of its 16-wide halves (Q6_K); none for Q4_0 / Q4_1 / Q5_0 / Q5_1.
The weight is then W = d (q - 8), d q + m, d (q - 16), (d sc) q - dmin mn, (d sc) (q - 32) in
float32, equal to `gguf.quants.dequantize` bit for bit (every product is exact in float32), rounded to
bf16 per tile in the kernel. Memory: the file's bytes for Q4_0, Q4_1, Q5_0, Q5_1 and Q6_K; Q4_K and Q5_K
keep their 6-bit scales in whole bytes (+0.125 bit a weight); rows are padded to 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from tessera.quant import invariant
from tessera.quant.gguf_kquant import _k_scale_codes, _nibble_subblocks, _q5_codes, _q6_codes

# Which way the kernel forms s and z from sup and sub (csrc: KQKind).
# Q4_1 is the Q5_1 kind without the fifth bit (s = d, z = m); Q4_0 has a kind of its own (z = -8 d).
KIND = {Q.Q4_0: 4, Q.Q4_1: 1, Q.Q5_0: 0, Q.Q5_1: 1, Q.Q4_K: 2, Q.Q5_K: 2, Q.Q6_K: 3}
PLANES = {Q.Q4_0: 0, Q.Q4_1: 0, Q.Q5_0: 1, Q.Q5_1: 1, Q.Q4_K: 0, Q.Q5_K: 1, Q.Q6_K: 2}


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16)[..., 0]


def split_blocks(raw: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Raw blocks uint8 [R, bytes per row] -> (codes uint8 [R, K] (the whole code: 0..31 or 0..63),
    sup float16 [R, S, F] (F = 1 or 2 fields), sub uint8 / int8 [R, K / 32, 2] or None)."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, nbytes)
    nb = b.shape[1]
    sub = None
    if qtype == Q.Q4_0:  # byte j: weight j in the low nibble, weight j + 16 in the high one
        codes, sup = torch.cat([b[..., 2:] & 15, b[..., 2:] >> 4], -1), _f16(b[..., 0:2])[..., None]
    elif qtype == Q.Q4_1:
        codes, sup = torch.cat([b[..., 4:] & 15, b[..., 4:] >> 4], -1), torch.stack([_f16(b[..., 0:2]), _f16(b[..., 2:4])], -1)
    elif qtype == Q.Q5_0:
        codes, sup = _q5_codes(b[..., 2:6], b[..., 6:22]), _f16(b[..., 0:2])[..., None]
    elif qtype == Q.Q5_1:
        codes, sup = _q5_codes(b[..., 4:8], b[..., 8:24]), torch.stack([_f16(b[..., 0:2]), _f16(b[..., 2:4])], -1)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        sup = torch.stack([_f16(b[..., 0:2]), _f16(b[..., 2:4])], -1)
        sub = torch.stack(_k_scale_codes(b), -1).reshape(rows, nb * 8, 2)
        codes = _nibble_subblocks(b[..., 16:144] if qtype == Q.Q4_K else b[..., 48:176])
        if qtype == Q.Q5_K:
            qh = b[..., 16:48].reshape(rows, nb, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
            codes = codes | ((qh & 1) << 4)
    elif qtype == Q.Q6_K:
        codes, sup = _q6_codes(b), _f16(b[..., 208:210])[..., None]
        sub = b[..., 192:208].contiguous().view(torch.int8).reshape(rows, nb * 8, 2)
    else:
        raise ValueError(f"no tile layout for GGUF type {qtype.name}")
    return codes.reshape(rows, nb * block).to(torch.uint8), sup, sub


def weight(codes: torch.Tensor, sup: torch.Tensor, sub: torch.Tensor | None, qtype: Q) -> torch.Tensor:
    """float32 [R, K] from split_blocks' parts, with gguf's float32 operations."""
    rows, k = codes.shape
    per_sup = k // sup.shape[1]
    d, second = (sup[..., i].float().repeat_interleave(per_sup, dim=1) for i in (0, -1))
    q = codes.float()
    if qtype == Q.Q4_0:
        return d * (q - 8)
    if qtype == Q.Q5_0:
        return d * (q - 16)
    if qtype in (Q.Q4_1, Q.Q5_1):
        return d * q + second
    if qtype in (Q.Q4_K, Q.Q5_K):
        sc, mn = (sub[..., i].float().repeat_interleave(32, dim=1) for i in (0, 1))
        return (d * sc) * q - second * mn
    return (d * sub.reshape(rows, -1).float().repeat_interleave(16, dim=1)) * (q - 32)


def _bits_to_int32(bits: torch.Tensor) -> torch.Tensor:
    """[..., 32] of 0/1 -> int32 [...] with bit i = bits[..., i] (little-endian bytes)."""
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    packed = (bits.reshape(*bits.shape[:-1], 4, 8) * weights).sum(-1, dtype=torch.uint8)
    return packed.contiguous().view(torch.int32)[..., 0]


def _blocks3(v: torch.Tensor) -> torch.Tensor:
    """[N, B, F] -> [Nb, B, F, 16] (pack_blocks per field)."""
    return torch.stack([invariant.pack_blocks(v[..., i]) for i in range(v.shape[-1])], dim=2).contiguous()


@dataclass
class KQTiles:
    """One weight in the KQ format (see the module docstring)."""

    codes: torch.Tensor
    planes: torch.Tensor
    sup: torch.Tensor
    sub: torch.Tensor | None

    @classmethod
    def pack(cls, raw: torch.Tensor, qtype: Q) -> KQTiles:
        codes, sup, sub = split_blocks(raw, qtype)
        high = invariant.pack_tiles(codes >> 4)  # [Nb, Kb, 16, 16, 2]: a k-pair row's 32 values
        high = high.reshape(*high.shape[:3], 32)
        planes = [_bits_to_int32((high >> p) & 1) for p in range(PLANES[qtype])]
        shape = (*high.shape[:3], 0)
        return cls(invariant.pack_nibbles(codes & 15),
                   torch.stack(planes, -1).contiguous() if planes else torch.zeros(shape, dtype=torch.int32),
                   _blocks3(sup), None if sub is None else _blocks3(sub))

    def rows(self, ids: torch.Tensor, k: int, qtype: Q) -> torch.Tensor:
        """Rows `ids` of the weight as float32 [len(ids), K], exactly as the file's dequantization."""
        codes = invariant.nibble_rows(self.codes, ids, k)
        col, at = ids % 16, torch.arange(ids.numel())
        for p in range(self.planes.shape[-1]):
            bits = (self.planes[ids // 16, :, :, p, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [R, Kb, 16, 32]
            plane = torch.stack([bits[at, :, :, 2 * col], bits[at, :, :, 2 * col + 1]], -1)  # column col's pairs
            codes = codes | (plane.reshape(ids.numel(), -1)[:, :k].to(torch.uint8) << (4 + p))
        sup = self.sup[ids // 16, :, :, ids % 16]
        sub = None if self.sub is None else self.sub[ids // 16, :, :, ids % 16]
        return weight(codes, sup, sub, qtype)

    def matmul(self, x: torch.Tensor, qtype: Q, n: int) -> torch.Tensor:
        """x [M, K] (bf16 or float32) @ W.T -> [M, n] in x's dtype, on the AMX kernel."""
        dtype = x.dtype
        if dtype not in (torch.bfloat16, torch.float32):
            x = x.float()
        y = torch.ops.tessera_qgemm.kqgemm(x.contiguous(), self.codes, self.planes, self.sup, self.sub, KIND[qtype],
                                           n, x.shape[1])
        return y if y.dtype == dtype else y.to(dtype)

    def logits_argmax(self, x: torch.Tensor, qtype: Q, n: int, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 x [M, K] -> (matmul(x).float(), each row's first maximum of it), the ids found in the
        kernel's store epilogue (an lm_head of these blocks); without `logits` the first is [M, 0]."""
        return torch.ops.tessera_qgemm.kqgemm_logits(x.contiguous(), self.codes, self.planes, self.sup, self.sub,
                                                     KIND[qtype], n, x.shape[1], True, logits)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.planes, self.sup, self.sub) if t is not None)
