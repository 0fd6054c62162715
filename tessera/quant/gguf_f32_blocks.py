"""A GGUF model in float32 decodes from the file's own blocks: the same bits from a sixth to a third of the bytes.

Loaded in float32, a GGUF model's linear weight is W, the file's dequantization by `gguf.quants`
(numpy, float32), per block of 32 (16 for Q6_K) weights of a row, d, m and dmin float16:

| type | W | kept as (linear_f32_blocks' format) |
|---|---|---|
| Q4_1, Q4_0 | fl(fl(d q) + m); d (q - 8) | nibbles, float16 d and m (Q4_0: m = -8 d, exact) |
| Q8_0, Q5_0 | d q; d (q - 16) | int8 codes (q - 16), float16 d |
| Q4_K | fl((d sc) q - dmin mn) | nibbles, float32 d sc and -dmin mn (exact products) |
| Q6_K | fl((d sc) (q - 32)) | int8 codes per 16, float32 d sc |
| Q5_1, Q5_K | fl(d q + m); as Q4_K | int8 codes, float32 d and m |

d q is exact in float32 (at most 11 + 8 significant bits; Q4_K's and Q5_K's d sc q 22), so an
FMA q * d + m, or a product q * d where the loader had only that, rounds exactly as the loader
did: the weight bit for bit (one exception: a Q4_0 zero weight under a negative d is +0 here and
-0 in numpy, a sign no output shows: an FMA chain's accumulator starts at +0 and never becomes -0,
and acc + x * (+-0) is acc). The AVX2 register tiles (csrc/f32_gemm_avx2.cpp, `linear_f32_blocks`)
rebuild W that way in registers and feed the float32 kernel's own FMA chain over k in order: the
same output bits as `linear_f32` on W, reading 0.63 (Q4_1) to 1.25 bytes a weight instead of 4. A
decode step of the default model (Q4_1 layers, a Q8_0 tied lm_head) reads ~96 MB instead of 538.

Where: float32 InvariantLinear weights on the AVX2 tiles (CPUs without AVX-512: Zen 3), slots
whose parts all have one of those types (other types keep their float32 weight), calls of up to
BLOCKS_MAX_ROWS rows (above, the tiles are compute-bound and the rebuild would be repeated per
row tile, so the float32 panels serve prefill chunks and large batches: both stay in memory).
`--quantization gguf` keeps the K-quant and Q5 layers as these blocks only and computes from them
at every size (gguf_kquant.GGUFBlockLinear). `TESSERA_GGUF_CODES=0` turns both off, as for the
bf16 engine's blocks (gguf_codes.py).

Layout (panel order, as the float32 weight's 64-column panels, gate_up pairs included): uint8
[np / 64, k / block, block bytes], each block the panel's scales, then its codes: nibbles as
[32 k][8 lanes] uint32 words whose nibble v is column 8 v + lane's q, or int8 [block k][64].
BLOCK_BYTES has the sizes.
"""

from __future__ import annotations

import logging
import os

import torch
from gguf import GGMLQuantizationType as Q

from tessera import memory

logger = logging.getLogger("tessera")

# Row counts up to this take the blocks. Zen 3, the default model's linears, blocks against
# float32 panels (benchmarks/linears.py): see docs/kernels.md, session 38.
BLOCKS_MAX_ROWS = 8
# linear_f32_blocks' format argument: 0 the Q4 kernel, 1 the Q8 one (Q5_0's W = d (q - 16) is
# d times an int8 code, so it takes the Q8 layout: 1.06 bytes a weight against its file's 0.69),
# 2 the Q4 kernel with float32 scales (Q4_K's 32-weight sub-blocks: d sc and dmin mn are exact in
# float32, not in float16), 3 the Q8 kernel with float32 scales per 16 k (Q6_K: W = fl((d sc) q)
# with d sc exact, one rounding as the kernel's product), 4 the Q8 kernel with float32 d and m
# (Q5_1's W = d q + m and Q5_K's (d sc) q - dmin mn on 5-bit codes, d q exact)
FORMAT = {Q.Q4_0: 0, Q.Q4_1: 0, Q.Q8_0: 1, Q.Q5_0: 1, Q.Q4_K: 2, Q.Q6_K: 3, Q.Q5_1: 4, Q.Q5_K: 4}
# bytes per 32 weights in that layout (the file's: Q4_0 18, Q4_1 20, Q8_0 34, Q5_0 22, Q5_1 24,
# Q4_K 18, Q5_K 22, Q6_K 26.25)
BLOCK_BYTES = {Q.Q4_0: 20, Q.Q4_1: 20, Q.Q8_0: 34, Q.Q5_0: 34, Q.Q4_K: 24, Q.Q6_K: 40, Q.Q5_1: 40, Q.Q5_K: 40}
PANEL, BLOCK = 64, 32


def enabled() -> bool:
    """Whether a float32 engine here reads the blocks: the AVX2 tiles, not turned off."""
    from tessera.kernels.linear import _on_avx2_tiles

    return os.environ.get("TESSERA_GGUF_CODES", "1") != "0" and _on_avx2_tiles()


def _panel_rows(t: torch.Tensor, pairs: bool) -> torch.Tensor:
    """Per-row tensor [N, ...] in the float32 panels' column order, padded to whole panels with zeros."""
    if pairs:  # kernels/linear.py's _pack: 8 gate rows, then the same 8 up rows, in turn
        t = t.reshape(2, t.shape[0] // 16, 8, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    pad = -t.shape[0] % PANEL
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _scales(s: torch.Tensor, pairs: bool) -> torch.Tensor:
    """float16 or float32 [N, blocks] -> uint8 [np / 64, blocks, 128 or 256]: a panel's 64 scales a block."""
    s = _panel_rows(s, pairs)
    return s.view(-1, PANEL, s.shape[1]).transpose(1, 2).contiguous().view(torch.uint8)


def pack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15, d and m [N, K / 32] (W = d q + m), both float16 or both float32
    -> uint8 [np / 64, K / 32, 1280 or 1536]; pairs: a gate_up weight in the paired float32 layout."""
    if d.dtype != m.dtype or d.dtype not in (torch.float16, torch.float32):
        raise ValueError("pack_q4: d and m both float16 or both float32")
    c = _panel_rows(codes, pairs)
    p, kb = c.shape[0] // PANEL, c.shape[1] // BLOCK
    # [panel, v, lane, block, j] -> [panel, block, j, lane, v]; nibble pairs (v = 2 b, 2 b + 1) to byte b
    c = c.view(p, 8, 8, kb, BLOCK).permute(0, 3, 4, 2, 1).reshape(p, kb, BLOCK, 8, 4, 2)
    nibbles = (c[..., 0] | (c[..., 1] << 4)).reshape(p, kb, BLOCK * 32)
    return torch.cat([_scales(d, pairs), _scales(m, pairs), nibbles], dim=2).contiguous()


def pack_q8(codes: torch.Tensor, d: torch.Tensor, pairs: bool = False, m: torch.Tensor | None = None) -> torch.Tensor:
    """codes int8 [N, K] and, per block of codes in a row:
    - d float16 [N, K / 32] (W = d q) -> uint8 [np / 64, K / 32, 2176];
    - d float32 [N, K / 16] (Q6_K's sub-blocks) -> uint8 [np / 64, K / 16, 1280];
    - d and m float32 [N, K / 32] (W = d q + m) -> uint8 [np / 64, K / 32, 2560]."""
    block = BLOCK if m is not None or d.dtype != torch.float32 else 16
    if d.shape[1] * block != codes.shape[1] or (m is not None and (m.shape != d.shape or d.dtype != torch.float32)):
        raise ValueError("pack_q8: float16 d per 32 codes, float32 d per 16, or float32 d and m per 32")
    scales = [_scales(d if d.dtype == torch.float32 else d.to(torch.float16), pairs)]
    if m is not None:
        scales.append(_scales(m, pairs))
    c = _panel_rows(codes, pairs)
    p, kb = c.shape[0] // PANEL, c.shape[1] // block
    c = c.view(p, PANEL, kb, block).permute(0, 2, 3, 1).reshape(p, kb, block * PANEL).view(torch.uint8)
    return torch.cat([*scales, c], dim=2).contiguous()


def panel_weight(blocks: torch.Tensor, fmt: int, p: int) -> torch.Tensor:
    """Panel p of the weight the blocks hold, float32 [k, 64], as the kernel rebuilds it (d q, then
    + m): the float32 weight's panel where the blocks are its file's, bit for bit but for Q4_0's
    zeros (the module docstring says why no output shows them)."""
    return _panels(blocks[p:p + 1], fmt)[0]


def weight_rows(blocks: torch.Tensor, fmt: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (long [R]) of the (unpaired) weight the blocks hold, float32 [R, k], as panel_weight
    computes them: what a layer that keeps only its blocks dequantizes (and looks embeddings up) with."""
    panels, where = torch.unique(ids // PANEL, return_inverse=True)
    w = _panels(blocks[panels], fmt)  # [U, k, 64]
    return w[where, :, ids % PANEL]


def _panels(b: torch.Tensor, fmt: int) -> torch.Tensor:
    """Blocks uint8 [P, blocks, bytes] -> the panels' weights float32 [P, k, 64]."""
    p = b.shape[0]
    if fmt in (FORMAT[Q.Q8_0], FORMAT[Q.Q6_K], FORMAT[Q.Q5_1]):
        at, block = {FORMAT[Q.Q8_0]: (128, BLOCK), FORMAT[Q.Q6_K]: (256, 16), FORMAT[Q.Q5_1]: (512, BLOCK)}[fmt]
        scales = b[..., :at].contiguous()
        scales = scales.view(torch.float16).float() if at == 128 else scales.view(torch.float32)
        q = b[..., at:].contiguous().view(torch.int8).view(p, -1, block, PANEL).float()  # [P, blocks, block, 64]
        if at == 512:  # d and m [P, blocks, 64] each
            d, m = scales.chunk(2, dim=-1)
            return (q * d[:, :, None, :] + m[:, :, None, :]).reshape(p, -1, PANEL)
        return (q * scales[:, :, None, :]).reshape(p, -1, PANEL)
    at = 512 if fmt == FORMAT[Q.Q4_K] else 256  # where the codes start: d and m, 64 float32 or float16 each
    scales = b[..., :at].contiguous()
    scales = scales.view(torch.float32) if at == 512 else scales.view(torch.float16).float()
    d, m = scales.chunk(2, dim=-1)  # [P, blocks, 64] each
    words = b[..., at:].reshape(p, -1, BLOCK, 8, 4).to(torch.int64)  # [P, blocks, 32, lane, byte]
    words = (words << torch.tensor([0, 8, 16, 24])).sum(-1)  # [P, blocks, 32, lane]
    q = (words[..., None, :] >> (4 * torch.arange(8))[:, None]) & 15  # [P, blocks, 32, v, lane]
    q = q.reshape(p, -1, BLOCK, PANEL).float()
    return (q * d[:, :, None, :] + m[:, :, None, :]).reshape(p, -1, PANEL)


def blocks_of(raw: torch.Tensor, qtype, rows: int, pairs: bool) -> torch.Tensor:
    """A weight's GGUF block bytes uint8 [rows, bytes per row] (a fused slot's parts in order) of a
    FORMAT type -> the kernel's blocks in panel order (pairs: a gate_up in the paired layout)."""
    from tessera.quant.gguf_int8_activations import decode_q4_blocks
    from tessera.quant.gguf_kquant import KQUANT_TYPES, kquant_codes
    from tessera.quant.gguf_native import _blocks

    if qtype == Q.Q8_0:
        b = _blocks(raw.numpy(), Q.Q8_0, rows)
        d = torch.from_numpy(b[..., 0:2].copy()).view(torch.float16)[..., 0]
        codes = torch.from_numpy(b[..., 2:].copy()).view(torch.int8).reshape(rows, -1)
        return pack_q8(codes, d, pairs)
    if qtype in KQUANT_TYPES:  # the file's codes and exact scales (Q4_K 4-bit, the others int8)
        codes, d, m = kquant_codes(raw, qtype)
        return pack_q4(codes, d, m, pairs) if qtype == Q.Q4_K else pack_q8(codes, d, pairs, m)
    return pack_q4(*decode_q4_blocks(_blocks(raw.numpy(), qtype, rows), qtype), pairs)


@torch.no_grad()
def attach_f32_blocks(model, files) -> int:
    """Give each float32 InvariantLinear whose GGUF parts all have one FORMAT type its blocks in
    panel order; returns how many. Not a GGUF file, or not enabled here: 0."""
    from tessera.kernels.linear import InvariantLinear
    from tessera.model.gguf_loader import GGUFModelFiles
    from tessera.quant.gguf_native import slot_block_rows

    if not isinstance(files, GGUFModelFiles) or not enabled():
        return 0
    found = []
    for slot in model.linear_slots(quantize_lm_head=True):
        w = getattr(slot.owner, slot.attr)
        if type(w) is not InvariantLinear or w.dtype != torch.float32 or not slot.parts:
            continue
        if (found_rows := slot_block_rows(files, slot.parts, FORMAT)) is None:
            continue
        qtype, raw = found_rows
        if raw.shape[0] != w.out_features:
            continue
        try:
            blocks = blocks_of(raw, qtype, raw.shape[0], w.pairs)
        except ValueError as e:  # a Q4_0 scale that overflows float16 as m = -8 d
            logger.debug("%s keeps its float32 weight: %s", slot.attr, e)
            continue
        # The loader's weight must be the blocks' (a family whose loader changes a weight after
        # dequantizing it would not be): its first panel is checked value for value (bit for bit
        # but for the sign of Q4_0's zeros, see the module docstring).
        if not torch.equal(panel_weight(blocks, FORMAT[qtype], 0), w.packed[0]):
            logger.warning("%s: the float32 weight is not its GGUF blocks' dequantization; it keeps its float32 "
                           "weight for every call", ", ".join(slot.parts))
            continue
        found.append((w, blocks, FORMAT[qtype]))
    # One huge-page buffer in call order, as the float32 weights' (tessera.memory.Arena): a decode
    # streams it from layer to layer.
    copies = iter(memory.copies_in_order([b for _, b, _ in found], huge=True))
    for w, _, fmt in found:
        w.attach_f32_blocks(next(copies), fmt)
    if found:
        nbytes = sum(b.numel() for _, b, _ in found)
        logger.info("decode steps read %d float32 linear weights from the GGUF blocks (%.1f MiB; the float32 "
                    "copies serve prefill chunks, same bits either way)", len(found), nbytes / 2**20)
    return len(found)
