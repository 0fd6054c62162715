"""int8 weight-only quantization: one symmetric scale per output channel, float activations.

W[n, k] = scale[n] * q[n, k], q in [-127, 127]. The scales are rounded to bfloat16 when
quantizing, so the bf16 kernel and the float32 one compute with the very same weight.

Kernels, chosen by the number of rows M (measured on an AMD Zen 3 without AVX-512, one thread,
weights cold in cache; `benchmarks/quant.py --kernels` re-measures):
- "int8pack": `aten._weight_int8pack_mm` with bf16 activations. It reads 1 byte per weight and is
  about 1.4x faster than the float32 GEMM at M = 1, but loses from M = 16 on (bf16 arithmetic is
  emulated on this CPU). Fed float32 activations it is 5-10x slower still, so x goes in as bf16.
- "native": the C++ AVX-512 GEMV (native_gemv.py) for M <= NATIVE_MAX_ROWS, reading the int8 codes
  once and converting them in registers; taken whenever it is built.
- "dequant": convert the codes to the activation dtype tile by tile (tiled_matmul) and run the
  float GEMM on each tile, scaling the output columns: the float32 GEMM's speed plus one
  conversion pass over the weight.
- "invariant" (the only kernel where it exists: CPUs with AVX-512 BF16, invariant.py): the codes
  in tile order, converted to bf16 exactly, AMX tiles (or VDPBF16PS without AMX) with fp32 sums
  in a fixed K order, the scale applied to the sum. One kernel for every M, so a row's result
  never depends on the batch. The torch kernels above are kept for CPUs without AVX-512 BF16
  (and TESSERA_QUANT_INVARIANT=0); they pick by M and are not batch-invariant.
"""

from __future__ import annotations

import torch

from tessera.quant import invariant, native_gemv
from tessera.quant.linear import QuantLinear, tile_rows_for, tiled_matmul

# Largest M for which int8pack beats dequantize + float32 GEMM (measured 1.2-1.9x at M = 4,
# 0.7-0.9x at M = 16).
INT8PACK_MAX_ROWS = 8


def round_to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


class Int8Linear(QuantLinear):
    method = "int8"

    @property
    def kernels(self) -> tuple[str, ...]:  # "native" only where the C++ extension is built
        if self.invariant:
            return ("invariant",)
        return (("native",) if native_gemv.available() else ()) + ("int8pack", "dequant")

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        """qweight: int8 [out, in]; scale: [out], representable in bfloat16."""
        super().__init__(qweight.shape[0], qweight.shape[1])
        self.invariant = invariant.enabled(qweight.device)
        if self.invariant:  # the tile-order codes are the only copy; scale padded to the tiles' rows
            self.register_buffer("tiles", invariant.pack_tiles(qweight))
            self.register_buffer("scale", invariant.pack_blocks(scale.float()[:, None]).view(-1))
        else:
            self.register_buffer("scale", scale.float().contiguous())
            self.register_buffer("qweight", qweight.contiguous())
            self.register_buffer("scale_bf16", scale.to(torch.bfloat16).contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Linear:
        w = weight.float()
        scale = round_to_bf16(w.abs().amax(dim=1) / 127)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale)

    def codes(self) -> torch.Tensor:
        """The int8 codes [out, in]."""
        if self.invariant:
            return invariant.unpack_tiles(self.tiles, self.out_features, self.in_features)
        return self.qweight

    def dequantize(self) -> torch.Tensor:
        return self.codes().float() * self.scale[: self.out_features, None]

    def select_kernel(self, num_rows: int) -> str:
        if self.invariant:
            return "invariant"
        cpu = self.qweight.device.type == "cpu"
        if cpu and num_rows <= native_gemv.NATIVE_MAX_ROWS and native_gemv.available():
            return "native"
        if cpu and num_rows <= INT8PACK_MAX_ROWS:
            return "int8pack"
        return "dequant"

    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == "invariant" and self.invariant:
            return invariant.qgemm(x, self.tiles, self.scale, None, invariant.INT8, self.out_features)
        if kernel == "native":
            return native_gemv.gemv_int8(x, self.qweight, self.scale)
        if kernel == "int8pack":
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale_bf16)
            return y.to(x.dtype)
        if kernel == "dequant":
            def fill(start: int, end: int, tile: torch.Tensor) -> None:
                tile.copy_(self.qweight[start:end])

            y = tiled_matmul(x, self.out_features, tile_rows_for(self.in_features), fill)
            return y.mul_(self.scale.to(x.dtype))
        raise ValueError(f"unknown int8 kernel {kernel!r}; have {self.kernels}")
