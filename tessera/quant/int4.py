"""int4 weight-only quantization, group-wise with a scale and a zero point per group.

Each run of `group_size` weights along a row (32, 64 or 128) has its own scale s and offset z:
W[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g], q in 0..15, g = k // group_size. This is the
convention of PyTorch's int4 CPU kernel; min/max quantization gives s = (max - min) / 15 and
z = min + 8 s. s and z are stored in bfloat16 (the kernel's format) and rounded to it before the
codes are chosen, so every kernel computes with the same weight. GGUF's Q4_0 and Q4_1 blocks map
onto this format with group size 32 (see gguf_native.py).

The codes live only in the kernel's packed layout: [N, K / 2] bytes, rows taken in blocks of 32
(AVX2) or 64 (AVX-512), each block stored k-major with row j in the low nibble and row j + B/2 in
the high nibble of byte j (a tail block of 16..48 rows pairs rows 2i, 2i + 1). `unpack_codes`
reads it back; `packed_layout()` checks which layout this build of torch writes.

Kernels (measured on an AMD Zen 3 without AVX-512, one thread, weights cold in cache):
- "int4pack": `aten._weight_int4pack_mm_for_cpu` with bf16 activations: 1.2-2x the float32 GEMM
  at M <= 4 (it reads half a byte per weight), slower from M = 16 on; float32 or float16
  activations are 10-100x slower (scalar code), so x goes in as bf16.
- "native": the C++ AVX-512 GEMV (native_gemv.py) on the packed codes themselves, for
  M <= NATIVE_MAX_ROWS when this torch packs 64-row blocks (its AVX-512 layout). Not chosen by
  default: on a Sapphire Rapids-class Xeon it ran at 0.8-0.9x int4pack's speed at M = 1.
- "dequant": unpack a tile of row blocks at a time into float and multiply it (see
  `_dequant_matmul`); for prefill-sized M the unpack is a small fraction of the GEMM.
- "invariant" (the only kernel where it exists: CPUs with AVX-512 BF16, invariant.py): codes in
  tile order; on AMX W = (q - 8) s + z in fp32 rounded once to bf16 in registers, tile products
  with fp32 sums in a fixed K order; without AMX (Zen 4/5) the exact codes q - 8 times x in one
  VDPBF16PS chain per group, scale and zero applied to that partial sum. One kernel for every M,
  so a row's result never depends on the batch. The codes then live only in that layout
  (`tiles`, `tile_scale`, `tile_zero`), not in torch's; the kernels above serve CPUs without
  AVX-512 BF16 (and TESSERA_QUANT_INVARIANT=0), and are not batch-invariant.
"""

from __future__ import annotations

import functools

import torch

from tessera.quant import invariant, native_gemv
from tessera.quant.linear import TILE_BYTES, QuantLinear, scratch, tile_rows_for, tiled_matmul

# Largest M for which int4pack beats unpack + float32 GEMM (1.2-2.6x at M = 4, 0.7-0.8x at 16).
INT4PACK_MAX_ROWS = 8
# From this M on, "dequant" fills row-major tiles and runs plain GEMMs (see _dequant_matmul).
ROW_MAJOR_MIN_ROWS = 128
_ROW_MULTIPLE = 16  # the kernel handles row blocks of 16, 32, 48 or 64


def _pack_codes_for_kernel(q: torch.Tensor) -> torch.Tensor:
    """q: uint8 codes [N, K] with N a multiple of 16 -> the int4 kernel's packed bytes [N, K / 2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def unpack_codes(packed: torch.Tensor, n: int, k: int, block_rows: int) -> torch.Tensor:
    """The inverse of the kernel's packing for row blocks of `block_rows` (see the module doc)."""
    flat = packed.reshape(-1)
    out = torch.empty(n, k, dtype=torch.uint8, device=packed.device)
    full = n // block_rows if block_rows else 0
    if full:
        blocks = flat[: full * k * block_rows // 2].view(full, k, block_rows // 2)
        rows = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [blocks, K, block_rows]
        out[: full * block_rows] = rows.permute(0, 2, 1).reshape(full * block_rows, k)
    tail = n - full * block_rows
    if tail:
        t = flat[full * k * block_rows // 2 :].view(k, tail // 2)
        out[full * block_rows :] = torch.stack([t & 15, t >> 4], dim=2).reshape(k, tail).t()
    return out


@functools.cache
def packed_layout() -> int:
    """Row block size of the packed layout this torch build writes: 64, 32, or 0 (pairs only).

    Found by packing a probe and reading it back, so a torch that packs differently is caught at
    start-up instead of computing with scrambled weights.
    """
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (64 * 2 + 16, 64), dtype=torch.uint8, generator=gen)
    packed = _pack_codes_for_kernel(probe)
    for block_rows in (64, 32, 0):
        if torch.equal(unpack_codes(packed, *probe.shape, block_rows), probe):
            return block_rows
    raise RuntimeError(
        "this torch build packs int4 weights in a layout tessera cannot read back; "
        "use --quantization int8 or w8a8, or the torch version pinned in the Makefile"
    )


class Int4Linear(QuantLinear):
    method = "int4"

    @property
    def kernels(self) -> tuple[str, ...]:  # "native" only where the C++ extension is built
        if self.invariant:
            return ("invariant",)
        return (("native",) if native_gemv.available() else ()) + ("int4pack", "dequant")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> None:
        """codes: uint8 [out, in] in 0..15; scale, zero: [out, in / group_size] (kernel convention)."""
        out_features, in_features = codes.shape
        super().__init__(out_features, in_features)
        if in_features % group_size:
            raise ValueError(f"group size {group_size} does not divide in_features {in_features}; "
                             f"choose a --quant-group-size that does (32 divides most)")
        self.group_size = group_size
        self.num_groups = in_features // group_size
        self.invariant = invariant.enabled(codes.device) and group_size % 32 == 0
        if self.invariant:  # tile order only (see the module doc)
            self.register_buffer("tiles", invariant.pack_nibbles(codes))
            self.register_buffer("tile_scale", invariant.pack_blocks(scale.to(torch.bfloat16)))
            self.register_buffer("tile_zero", invariant.pack_blocks(zero.to(torch.bfloat16)))
            self.padded_rows = out_features
            return
        self.padded_rows = -(-out_features // _ROW_MULTIPLE) * _ROW_MULTIPLE
        pad = self.padded_rows - out_features
        if pad:  # padding rows compute zeros and are sliced off
            codes = torch.cat([codes, codes.new_full((pad, in_features), 8)])
            scale = torch.cat([scale, scale.new_zeros(pad, self.num_groups)])
            zero = torch.cat([zero, zero.new_zeros(pad, self.num_groups)])
        self.register_buffer("packed", _pack_codes_for_kernel(codes))
        # The kernel wants [groups, N, 2] = (scale, zero) pairs.
        self.register_buffer("scales_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16)
                             .contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int) -> Int4Linear:
        n, k = weight.shape
        if k % group_size:
            raise ValueError(f"group size {group_size} does not divide in_features {k}; "
                             f"choose a --quant-group-size that does (32 divides most)")
        w = weight.float().view(n, k // group_size, group_size)
        lo, hi = w.amin(dim=2), w.amax(dim=2)
        scale = ((hi - lo) / 15).to(torch.bfloat16).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        q = torch.round((w - zero[..., None]) / scale[..., None]) + 8
        return cls(q.clamp_(0, 15).to(torch.uint8).view(n, k), scale, zero, group_size)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> Int4Linear:
        """Codes quantized elsewhere (GGUF blocks); scale and zero are rounded to bfloat16."""
        return cls(codes, scale, zero, group_size)

    def codes(self) -> torch.Tensor:
        if self.invariant:
            return invariant.unpack_nibbles(self.tiles, self.out_features, self.in_features)
        return unpack_codes(self.packed, self.padded_rows, self.in_features, packed_layout())[: self.out_features]

    def _fill(self, start: int, end: int, tile: torch.Tensor) -> None:
        """Rows start..end-1 (start at a block boundary) dequantized into tile [rows, K], exactly
        (q - 8) * s + z."""
        k, rows, block = self.in_features, end - start, packed_layout()
        packed = self.packed.view(-1)[start * k // 2 : end * k // 2]
        full = rows // block if block else 0  # layout 0: all rows stored in pairs
        if full:
            blocks = packed[: full * k * block // 2].view(full, k, block // 2)
            t = tile[: full * block].view(full, block, k)
            t[:, : block // 2].copy_((blocks & 15).transpose(1, 2))
            t[:, block // 2 :].copy_((blocks >> 4).transpose(1, 2))
        if rows > full * block:  # a tail block of 16..48 rows
            tile[full * block :].copy_(unpack_codes(packed[full * k * block // 2 :], rows - full * block, k, 0))
        sz = self.scales_zeros[:, start:end].to(tile.dtype)  # [groups, rows, 2]
        groups = tile.view(rows, self.num_groups, self.group_size)
        groups.sub_(8).mul_(sz[..., 0].t()[..., None]).add_(sz[..., 1].t()[..., None])

    def scales_and_zeros(self, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, z) as float32 [rows, groups] for rows `ids` (all rows when None)."""
        if self.invariant:
            n = self.out_features
            s = invariant.unpack_blocks(self.tile_scale, n).float()
            z = invariant.unpack_blocks(self.tile_zero, n).float()
        else:
            s, z = (self.scales_zeros[:, : self.out_features, i].t().float() for i in (0, 1))
        return (s, z) if ids is None else (s[ids], z[ids])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 [len(ids), in_features], exactly (q - 8) s + z."""
        if not self.invariant:
            from tessera.quant.gguf_embedding import int4_rows

            return int4_rows(self, ids)
        q = invariant.nibble_rows(self.tiles, ids, self.in_features).float()
        s, z = self.scales_and_zeros(ids)
        g = self.group_size
        return ((q.view(len(ids), -1, g) - 8) * s[..., None] + z[..., None]).view(len(ids), -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.invariant:
            s, z = self.scales_and_zeros()
            q = self.codes().float().view(self.out_features, -1, self.group_size)
            return ((q - 8) * s[..., None] + z[..., None]).view(self.out_features, -1).to(dtype)
        w = torch.empty(self.padded_rows, self.in_features, dtype=dtype)
        self._fill(0, self.padded_rows, w)
        return w[: self.out_features]

    def native_ok(self) -> bool:
        return (not self.invariant and self.packed.device.type == "cpu" and packed_layout() == native_gemv.INT4_BLOCK_ROWS
                and self.group_size % 16 == 0 and native_gemv.available())

    def select_kernel(self, num_rows: int) -> str:
        if self.invariant:
            return "invariant"
        # "native" is chosen on AVX2-only CPUs (gemv_avx2.cpp: 1.55-1.6x faster than int4pack at
        # M = 1 on Zen 3, session 31); on AVX-512 ones it measured slower than int4pack at M = 1
        # (docs/quantization.md).
        if native_gemv.avx2_only() and num_rows <= native_gemv.NATIVE_MAX_ROWS and self.native_ok():
            return "native"
        return "int4pack" if num_rows <= INT4PACK_MAX_ROWS else "dequant"

    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == "invariant" and self.invariant:
            return invariant.qgemm(x, self.tiles, self.tile_scale, self.tile_zero, invariant.INT4, self.out_features)
        if kernel == "native":
            y = native_gemv.gemv_int4pack(x, self.packed, self.scales_zeros, self.group_size)
            return y[:, : self.out_features] if self.padded_rows > self.out_features else y
        if kernel == "int4pack":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.packed, self.group_size, self.scales_zeros
            )
            return y[:, : self.out_features].to(x.dtype)
        if kernel == "dequant":
            return self._dequant_matmul(x)
        raise ValueError(f"unknown int4 kernel {kernel!r}; have {self.kernels}")

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T, dequantizing a tile of row blocks at a time in the packed layout itself.

        A packed block is k-major ([K, block rows], low nibbles then high nibbles), which is
        already the [K, N] operand x @ W.T wants: unpacking it needs no transpose, and each
        block is multiplied as one batch entry of a bmm. W = q * s + (z - 8 s) per group.
        """
        k, block, gs, groups = self.in_features, packed_layout(), self.group_size, self.num_groups
        m = x.shape[0]
        if m >= ROW_MAJOR_MIN_ROWS or not block:
            # Prefill-sized M: GEMMs over tiles of hundreds of rows beat one bmm entry per
            # 32-row block (0.9x at M = 256); the transpose into row-major is cheap next to them.
            y = tiled_matmul(x, self.padded_rows, tile_rows_for(k, max(block, _ROW_MULTIPLE)), self._fill)
            return y[:, : self.out_features] if self.padded_rows > self.out_features else y
        num_blocks = self.padded_rows // block
        tile_blocks = max(1, TILE_BYTES // (4 * k * block))
        buf = scratch(tile_blocks * k * block, x.dtype, x.device)
        packed = self.packed.view(-1)
        y = x.new_empty(m, self.padded_rows)
        for b0 in range(0, num_blocks, tile_blocks):
            b1 = min(b0 + tile_blocks, num_blocks)
            nb, rows = b1 - b0, slice(b0 * block, b1 * block)
            p = packed[b0 * block * k // 2 : b1 * block * k // 2].view(nb, k, block // 2)
            t = buf[: nb * k * block].view(nb, k, block)
            t[..., : block // 2].copy_(p & 15)
            t[..., block // 2 :].copy_(p >> 4)
            sz = self.scales_zeros[:, rows].to(x.dtype).view(groups, nb, 1, block, 2).transpose(0, 1)
            scale = sz[..., 0]  # [nb, groups, 1, block]
            t.view(nb, groups, gs, block).mul_(scale).add_(sz[..., 1] - 8 * scale)
            y[:, rows].view(m, nb, block).copy_(torch.matmul(x, t).transpose(0, 1))
        if self.padded_rows > num_blocks * block:  # a tail block of 16..48 rows, stored in pairs
            tail = torch.empty(self.padded_rows - num_blocks * block, k, dtype=x.dtype)
            self._fill(num_blocks * block, self.padded_rows, tail)
            y[:, num_blocks * block :] = x @ tail.t()
        return y[:, : self.out_features] if self.padded_rows > self.out_features else y
