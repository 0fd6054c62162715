"""W8A8: int8 weights (one scale per output channel) times int8 activations (one scale per token,
computed at run time), multiplied in integers with exact integer accumulation.

y[m, n] = sx[m] * sw[n] * sum_k qx[m, k] * qw[n, k], with qw = round(W / sw) and
qx = round(x / sx) both in [-127, 127], sx = max|x[m]| / 127. No step turns the weight back into
floats.

Kernels (measured on an AMD Zen 3 without AVX-512 or VNNI, one thread, weights cold in cache):
- "fbgemm": FBGEMM's AVX2 u8 x s8 GEMM (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`)
  on the codes packed once at load. Its inner step (vpmaddubsw) adds two u8 x s8 products in
  int16 and saturates past 32767, which a u8 activation with a zero point of 128 reaches with
  ordinary values (128 x 127 x 2 > 32767). So the signed codes go in as two non-negative halves,
  qx = max(qx, 0) - max(-qx, 0), stacked as 2M rows with zero point 0: each is at most 127, each
  pair sum at most 2 x 127 x 127 = 32258, and the int32 sums are exact. The weight is packed with
  unit scale, so the kernel returns the integer sums (as float32, exact below 2^24); their
  difference is scaled by sw and sx. Against float32: 2-4x at M = 1 (it reads 1 byte per weight;
  the second row is nearly free), about 1.5-2.5x at M = 32-256. (Quantizing activations to 7 bits
  instead, one call with zero point 64, is as exact and a little faster at large M, but cost 6% of
  perplexity on the default model where full 8 bits cost 1.5%.)
- "invariant" (AMX CPUs, invariant.py; chosen there): the codes in AMX int8 tile order,
  `TDPBSSD` s8 x s8 -> exact int32 sums, read straight from memory (no dequantization). Integer
  sums are exact in any order, so every kernel here is batch-invariant; this one is the fastest.
- "int_mm": `torch._int_mm`. Exact, but on a CPU without AVX-512 VNNI it is a plain loop, 3-80x
  slower than float32: the fallback where FBGEMM is missing, and the kernel on CUDA (which needs
  M > 16 and a multiple of 8: rows are padded).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from tessera.quant import invariant
from tessera.quant.int8 import round_to_bf16
from tessera.quant.linear import QuantLinear

QMAX = 127


@functools.cache
def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


@contextlib.contextmanager
def _quantized_engine(name: str):
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (codes [M, K] as integer-valued float32 in [-127, 127], scales sx [M, 1]).

    The largest |x| of a row maps to exactly 127 (x * (127 / amax) rounds to it); an all-zero
    row gets codes 0. Few tensor ops: at M = 1 their fixed cost is what W8A8 has to beat."""
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
    return (x * (QMAX / amax)).round_(), amax.mul_(1 / QMAX)


def _pad_rows(x: torch.Tensor, minimum: int, multiple: int) -> torch.Tensor:
    rows = -(-max(minimum, x.shape[0]) // multiple) * multiple
    return x if rows == x.shape[0] else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


class W8A8Linear(QuantLinear):
    method = "w8a8"
    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        """qweight: int8 [out, in] in [-127, 127]; scale: [out]."""
        super().__init__(qweight.shape[0], qweight.shape[1])
        self.register_buffer("scale", scale.float().contiguous())
        self._fbgemm = None
        self.qweight: torch.Tensor | None = None
        self.invariant = invariant.w8a8_enabled(qweight.device)
        self.kernels = ("invariant",) if self.invariant else ("fbgemm", "int_mm")
        if self.invariant:  # AMX int8 tile order is the only copy
            self.register_buffer("tiles", invariant.pack_tiles(qweight, group=4))
        elif fbgemm_available() and qweight.device.type == "cpu":
            with warnings.catch_warnings(), _quantized_engine("fbgemm"):
                # Quantized tensors are deprecated in torch 2.13; FBGEMM's prepack still takes one.
                warnings.simplefilter("ignore", UserWarning)
                qw = torch._make_per_tensor_quantized_tensor(qweight.contiguous(), 1.0, 0)
                self._fbgemm = torch.ops.quantized.linear_prepack(qw, None)  # its copy is the only one kept
        else:
            self.register_buffer("qweight", qweight.contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> W8A8Linear:
        w = weight.float()
        scale = round_to_bf16(w.abs().amax(dim=1) / QMAX)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
        return cls(q, scale)

    def codes(self) -> torch.Tensor:
        """The int8 weight codes [out, in] (read back from FBGEMM's packing when it holds them)."""
        if self.invariant:
            return invariant.unpack_tiles(self.tiles, self.out_features, self.in_features)
        if self.qweight is not None:
            return self.qweight
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            qw, _ = torch.ops.quantized.linear_unpack(self._fbgemm)
        return qw.int_repr()

    def dequantize(self) -> torch.Tensor:
        return self.codes().float() * self.scale[:, None]

    def weight_bytes(self) -> int:
        if self.invariant:
            return super().weight_bytes()
        # FBGEMM's packing holds the int8 codes plus an int32 sum per column (its zero-point
        # correction); the float32 scales come on top.
        return self.out_features * self.in_features + 8 * self.out_features

    def select_kernel(self, num_rows: int) -> str:
        if self.invariant:
            return "invariant"
        return "fbgemm" if self._fbgemm is not None else "int_mm"

    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        qx, sx = quantize_per_token(x)
        m = qx.shape[0]
        if kernel == "invariant" and self.invariant:
            y = invariant.w8a8_sums(qx.to(torch.int8), self.tiles, self.out_features).float()
        elif kernel == "fbgemm":
            if self._fbgemm is None:
                raise ValueError("the fbgemm kernel is not available here (no FBGEMM engine, or not on CPU)")
            # Non-negative halves as integer-valued floats, scale 1, zero point 0: FBGEMM's own
            # rounding of them is exact, and it returns the integer sums (see the module doc).
            halves = torch.cat([qx, qx.neg()]).clamp_min_(0)
            sums = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(halves, 1.0, 0, self._fbgemm)
            y = sums[:m].sub_(sums[m:])
        elif kernel == "int_mm":
            q8 = qx.to(torch.int8)
            if q8.device.type == "cuda":
                q8 = _pad_rows(q8, minimum=17, multiple=8)
            y = torch._int_mm(q8, self.codes().t())[:m].float()
        else:
            raise ValueError(f"unknown w8a8 kernel {kernel!r}; have {self.kernels}")
        return y.mul_(sx * self.scale).to(x.dtype)
