"""Batch-invariant quantized matmul (csrc/invariant_qgemm.cpp): tile-order packing, loading, calling.

One kernel per weight format serves every row count: a row's result never depends on how
many rows share the call (decode, a batch of decodes, a prefill chunk of any size, a prefix-cache
suffix), so quantized models keep the "same request, same answer" guarantee of the float ones
(docs/reproducibility.md). The weight is stored once in tile order (per 16 output columns and
per 32-wide K step, the 512 weights of one AMX B tile); each call dequantizes a tile to bf16 in
registers and multiplies it on AMX with fp32 accumulation, K steps in order (on CPUs without AMX,
Zen 4/5, with AVX-512 BF16 dot products in the same order). bf16 activations go
in as they are; float32 activations as two bf16 halves (hi + lo, about 16 bits of mantissa).

`enabled()` is False without AVX-512 BF16 (w8a8: without AMX int8), without the built extension, off CPU, or with
`TESSERA_QUANT_INVARIANT=0`; the QuantLinear classes then keep their shape-picked torch kernels
(which are not batch-invariant). The pack/unpack pairs below are each other's inverse exactly;
tests check them and check the kernel against float64 math.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from tessera.native import load_extension

INT8, Q8_0, INT4, BF16 = 0, 1, 2, 3
# argmax_rows.h (the greedy argmax of the store epilogue) and silu_rows.h (the gated epilogue's
# silu): shared with the bf16 kernels' library
_SOURCES = (Path(__file__).parent / "csrc" / "invariant_qgemm.cpp",
            Path(__file__).parents[1] / "kernels" / "csrc" / "argmax_rows.h",
            Path(__file__).parents[1] / "kernels" / "csrc" / "silu_rows.h")


def cpu_has_amx() -> bool:
    from tessera.kernels import cpu_flags

    return {"amx_bf16", "amx_int8", "amx_tile", "avx512_bf16"} <= cpu_flags()


@functools.cache
def available() -> bool:
    """True when the kernel is built and loaded on a CPU with AVX-512 BF16 (AMX or not)."""
    from tessera.kernels import cpu_has_avx512_bf16

    if not cpu_has_avx512_bf16() or not load_extension("tessera_qgemm", _SOURCES):
        return False
    _register_fakes()
    return True


def enabled(device: torch.device | str = "cpu") -> bool:
    """Whether quantized layers built now use the invariant kernel (read at construction)."""
    return torch.device(device).type == "cpu" and os.environ.get("TESSERA_QUANT_INVARIANT", "1") != "0" and available()


def w8a8_enabled(device: torch.device | str = "cpu") -> bool:
    """The int8 x int8 kernel is AMX only (TDPBSSD); without it w8a8 keeps FBGEMM (exact too)."""
    return enabled(device) and cpu_has_amx()


def set_arithmetic(arithmetic: int) -> None:
    """-1 the machine's (AMX where it has it), 0 AVX-512 BF16, 1 AMX: for tests that run both
    arithmetics on a CPU with AMX. The engine keeps -1 (one arithmetic per machine)."""
    torch.ops.tessera_qgemm.set_arithmetic(arithmetic)


def _register_fakes() -> None:
    torch.library.register_fake("tessera_qgemm::qgemm")(
        lambda x, codes, scale, zero, fmt, n, k: x.new_empty(x.shape[0], n))
    torch.library.register_fake("tessera_qgemm::qgemm_logits")(
        lambda x, codes, scale, zero, fmt, n, k, argmax, logits=True: (
            x.new_empty(x.shape[0], n if logits else 0, dtype=torch.float32),
            x.new_empty(x.shape[0] if argmax else 0, dtype=torch.long)))
    torch.library.register_fake("tessera_qgemm::qgemm_silu")(
        lambda x, codes, scale, zero, fmt, n, k: x.new_empty(x.shape[0], n // 2))
    torch.library.register_fake("tessera_qgemm::w8a8")(
        lambda qx, codes, n: qx.new_empty(qx.shape[0], n, dtype=torch.int32))


def _round_up(v: int, multiple: int) -> int:
    return -(-v // multiple) * multiple


def _pad(t: torch.Tensor, rows: int, cols: int, value: float = 0) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t.contiguous()
    out = t.new_full((rows, cols), value)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def padded_shape(n: int, k: int, k_step: int = 32) -> tuple[int, int]:
    """Rows padded to whole pairs of 16-column blocks, K to whole K steps."""
    return _round_up(n, 32), _round_up(k, k_step)


# ---- tile order ----------------------------------------------------------------------------------
# A [N, K] weight becomes [Nb, Kb, 16 k pairs, 16 columns, 2]: element (nb, ks, kp, c, p) is
# W[16 nb + c, 32 ks + 2 kp + p]. w8a8 uses quads: [Nb, K / 64, 16, 16, 4].

def pack_tiles(w: torch.Tensor, group: int = 2, fill: float = 0) -> torch.Tensor:
    """[N, K] (any dtype) -> tile order, padded with `fill`; group = 2 (bf16 pairs) or 4 (int8 quads)."""
    n, k = w.shape
    np_, kp = padded_shape(n, k, 16 * group)
    p = _pad(w, np_, kp, fill)
    return p.view(np_ // 16, 16, kp // (16 * group), 16, group).permute(0, 2, 3, 1, 4).contiguous()


def unpack_tiles(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_tiles: tile order -> [N, K]."""
    nb, kb, kr, cols, group = tiles.shape
    return tiles.permute(0, 3, 1, 2, 4).reshape(nb * cols, kb * kr * group)[:n, :k]


def tile_rows(tiles: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of a tile-order weight, [len(ids), K], without unpacking the rest."""
    t = tiles[ids // 16, :, :, ids % 16]  # [R, Kb, 16, group]
    return t.reshape(ids.numel(), -1)[:, :k]


def pack_blocks(v: torch.Tensor) -> torch.Tensor:
    """Per-(row, K block) values [N, B] -> [Nb, B, 16] (rows padded with zeros to pairs of 16)."""
    n, b = v.shape
    return _pad(v, _round_up(n, 32), b).view(-1, 16, b).transpose(1, 2).contiguous()


def unpack_blocks(v: torch.Tensor, n: int) -> torch.Tensor:
    return v.transpose(1, 2).reshape(-1, v.shape[1])[:n]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> [Nb, Kb, 16, 16] bytes: in each 32-value k-pair row,
    byte i holds value i (low nibble) and value i + 16 (high). Padding rows hold code 8."""
    t = pack_tiles(codes, fill=8).reshape(-1, 32)
    return (t[:, :16] | (t[:, 16:] << 4)).view(_round_up(codes.shape[0], 32) // 16, -1, 16, 16)


def unpack_nibbles(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    flat = packed.view(-1, 16)
    t = torch.cat([flat & 15, flat >> 4], dim=1)  # [rows of 32 values]
    return unpack_tiles(t.view(*packed.shape[:2], 16, 16, 2), n, k)


def nibble_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of pack_nibbles' output as uint8 codes [len(ids), K]."""
    c = ids % 16  # a column's two values of a k-pair row sit at 2c, 2c + 1 of its 32
    byte_lo = packed[ids // 16]  # [R, Kb, 16, 16]
    vals = []
    for parity in (0, 1):
        e = 2 * c + parity  # value index in 0..31
        b = byte_lo[torch.arange(ids.numel()), :, :, e % 16]  # [R, Kb, 16]
        vals.append(torch.where((e >= 16)[:, None, None], b >> 4, b & 15))
    return torch.stack(vals, dim=-1).reshape(ids.numel(), -1)[:, :k]


# ---- calls ---------------------------------------------------------------------------------------

def qgemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: int,
          n: int) -> torch.Tensor:
    """x [M, K] (bf16 or float32; other dtypes go through float32) @ W.T -> [M, n] in x's dtype."""
    dtype = x.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    y = torch.ops.tessera_qgemm.qgemm(x.contiguous(), codes, scale, zero, fmt, n, x.shape[1])
    return y if y.dtype == dtype else y.to(dtype)


def qgemm_logits(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: int,
                 n: int, argmax: bool, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """bf16 x [M, K] @ W.T as float32 logits holding the bf16-rounded values (qgemm(x, ...).float()
    in one pass), and with argmax each row's first maximum of them (else None). AMX only. With
    `logits` False (argmax True) the logits are not stored: [M, 0], the ids alone."""
    logits, ids = torch.ops.tessera_qgemm.qgemm_logits(x.contiguous(), codes, scale, zero, fmt, n, x.shape[1], argmax,
                                                       logits)
    return logits, ids if argmax else None


def w8a8_sums(qx: torch.Tensor, codes: torch.Tensor, n: int) -> torch.Tensor:
    """Exact int32 sums qx [M, K] int8 @ codes.T -> [M, n]."""
    return torch.ops.tessera_qgemm.w8a8(qx.contiguous(), codes, n)
