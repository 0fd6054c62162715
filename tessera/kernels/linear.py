"""Batch-invariant float linear layers: the model's weights packed once for the C++ kernels.

`InvariantLinear` computes `x @ W.T (+ bias)` with the kernels of `csrc/invariant_kernels.cpp`:
bf16 on AMX tiles where the CPU has them, else AVX-512 BF16 dot products (Zen 4/5), both on the
same VNNI-packed weight; float32 with fixed-order FMA chains (transposed weight).
A row's result never depends on how many rows share the call, so a token's logits are the same
alone, in a batch, in a prefill chunk of any size or from the prefix cache.

`make_linears_invariant(model, ...)` swaps the float linear weights of a loaded model (qkv, o,
gate_up, down, lm_head) for InvariantLinear modules where a kernel exists for the dtype;
quantized layers keep their own kernels.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tessera import kernels, memory
from tessera.quant import invariant
from tessera.quant.gguf_f32_blocks import BLOCKS_MAX_ROWS

logger = logging.getLogger("tessera")


def packed_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The packed weight's shape: bf16 VNNI tiles [Np/16, Kp/2, 16, 2] (N, K padded to multiples
    of 32), float32 panels of 64 columns [Np/64, K, 64] (each contiguous: a decode streams it)."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return (-(-n // 32) * 2, -(-k // 32) * 16, 16, 2)
    return (-(-n // 64), k, 64)


def _pack(weight: torch.Tensor, out: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """weight [N, K] into the zero-filled `out` of `packed_shape(weight)`. pairs: a float32 gate_up
    weight (gate rows, then up rows) with its rows in pairs, 8 gate rows then the same 8 up rows in
    turn, so that one 16-column register tile holds a gate and its up (`pairs_layout_fits`)."""
    if pairs:
        inter = weight.shape[0] // 2
        weight = weight.reshape(2, inter // 8, 8, -1).transpose(0, 1).reshape(weight.shape)
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        np_, kp = out.shape[0] * 16, out.shape[1] * 2
        padded = torch.zeros(np_, kp, dtype=torch.bfloat16)
        padded[:n, :k] = weight
        return out.copy_(padded.view(np_ // 16, 16, kp // 2, 2).permute(0, 2, 1, 3))
    panels = out.shape[0]
    padded = torch.zeros(panels * 64, k, dtype=weight.dtype)
    padded[:n] = weight
    return out.copy_(padded.view(panels, 64, k).transpose(1, 2))


# The bf16 kernel's arithmetic: -1 the machine's (AMX where it has it), 0 AVX-512 BF16, 1 AMX.
# Only tests change it (to run both where the CPU has both): the engine keeps one per machine.
BF16_ARITHMETIC = -1


def bf16_arithmetic() -> str:
    """Which of the two bf16 arithmetics this machine's linears take (they round differently)."""
    return "AMX bf16" if kernels.cpu_has_amx_bf16() else "AVX-512 bf16"


def supported(dtype: torch.dtype) -> bool:
    """Whether an invariant kernel exists here for weights and activations of `dtype`."""
    if not kernels.available():
        return False
    if dtype == torch.bfloat16:
        return kernels.cpu_has_avx512_bf16()  # AMX where the CPU has it, else AVX-512 BF16
    return dtype == torch.float32


def pairs_layout_fits(weight: torch.Tensor) -> bool:
    """Whether a fused gate_up weight takes the paired float32 layout: on the AVX2 register tiles
    (CPUs without AVX-512), whole 64-column panels (intermediate size a multiple of 32). Its linear
    then stores silu(gate) * up from the registers (`InvariantLinear.forward_silu`), silu_mul's
    bits without the [M, 2 x inter] output: the default model's gate_up with its SiLU 7-9% faster
    at 8-512 rows on a Zen 3 (docs/kernels.md, session 35)."""
    return weight.dtype == torch.float32 and weight.shape[0] % 64 == 0 and _on_avx2_tiles()


def _on_avx2_tiles() -> bool:
    """Whether the float32 linear runs f32_gemm_avx2.cpp's register tiles here (AVX2 + FMA, no
    AVX-512), with the kernels built."""
    return supported(torch.float32) and "avx512f" not in kernels.cpu_flags() and kernels.cpu_has_avx2_fma()


def invariant_by_default(dtype: torch.dtype) -> bool:
    """Whether the engine takes these kernels for `dtype` without --deterministic: bf16 wherever
    they exist; float32 where the linear is f32_gemm_avx2.cpp's register tiles (AVX2 + FMA, no
    AVX-512: Zen 3), faster than MKL there at 1, 32 and 256 rows (docs/kernels.md, session 31)."""
    if not supported(dtype):
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float32 and _on_avx2_tiles())


class InvariantLinear(nn.Module):
    """y = x @ W.T (+ bias) with a batch-invariant kernel; W packed at construction."""

    def __init__(self, weight: torch.Tensor, out: torch.Tensor | None = None, pairs: bool = False) -> None:
        """out: a zero-filled tensor of `packed_shape(weight)` to pack into (an Arena's, so the
        weights a step streams sit on huge pages); default a buffer of its own. pairs: a fused
        gate_up weight in the paired float32 layout (`pairs_layout_fits`)."""
        super().__init__()
        if not supported(weight.dtype):
            raise ValueError(f"no batch-invariant linear kernel for {weight.dtype} on this CPU")
        if pairs and not pairs_layout_fits(weight):
            raise ValueError("the paired gate_up layout serves float32 gate_up weights whose intermediate size "
                             "is a multiple of 32, on AVX2 CPUs without AVX-512")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.pairs = pairs
        if out is None:
            out = memory.zeros(packed_shape(weight), weight.dtype, huge=True)
        self.register_buffer("packed", _pack(weight.detach(), out, pairs), persistent=False)
        # GGUF blocks of the same W for decode sizes (tessera/quant/gguf_codes.py): KQ tiles (the
        # layers' Q4/Q5 blocks) or Q8_0 tiles (a tied lm_head), at most one of the two
        self.codes = None
        self.codes_kind = -1
        self.q8_codes: tuple[torch.Tensor, torch.Tensor] | None = None
        self.codes_max_rows = 0  # calls of up to this many rows read the codes
        # a float32 weight's GGUF blocks in panel order (gguf_f32_blocks.py)
        self.f32_blocks: torch.Tensor | None = None
        self.f32_blocks_format = -1

    def attach_codes(self, tiles, kind: int, max_rows: int) -> None:
        """tiles: a gguf_tiles.KQTiles whose W, rounded to bf16, is this layer's weight; calls of
        up to max_rows rows (gguf_codes.max_rows()) then compute from it (the same bits, fewer bytes)."""
        if self.dtype != torch.bfloat16:
            raise ValueError("GGUF codes serve bf16 weights")
        self.codes, self.codes_kind, self.codes_max_rows = tiles, kind, max_rows

    def attach_q8_0(self, tiles: torch.Tensor, d: torch.Tensor, max_rows: int) -> None:
        """A GGUF Q8_0 weight in the quantized kernel's tile order (quant.invariant.pack_tiles of
        the codes, pack_blocks of the float16 d) whose W = bf16(d q) is this layer's weight: calls
        of up to max_rows rows read 1.06 bytes a weight instead of 2, same bits. The tied lm_head
        of a GGUF file (the default model's: 28.7 MiB instead of 54)."""
        if self.dtype != torch.bfloat16:
            raise ValueError("GGUF codes serve bf16 weights")
        self.q8_codes, self.codes_max_rows = (tiles, d), max_rows

    def attach_f32_blocks(self, blocks: torch.Tensor, fmt: int) -> None:
        """blocks: gguf_f32_blocks.blocks_of the GGUF blocks this float32 weight was dequantized
        from (fmt: gguf_f32_blocks.FORMAT's, linear_f32_blocks' format); calls of up to
        BLOCKS_MAX_ROWS rows then read them (the same bits, a sixth of the bytes for Q4_1)."""
        if self.dtype != torch.float32 or not _on_avx2_tiles():
            raise ValueError("GGUF blocks for a float32 weight need the AVX2 tiles (CPUs without AVX-512)")
        self.f32_blocks, self.f32_blocks_format = blocks, fmt

    def _from_f32_blocks(self, x: torch.Tensor) -> bool:
        return self.f32_blocks is not None and x.numel() <= BLOCKS_MAX_ROWS * x.shape[-1]

    def _from_codes(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        return ((self.codes is not None or self.q8_codes is not None) and bias is None and x.dim() == 2
                and x.shape[0] <= self.codes_max_rows)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._from_codes(x, bias):
            if self.q8_codes is not None:
                return invariant.qgemm(x, *self.q8_codes, None, invariant.Q8_0, self.out_features)
            c = self.codes
            return torch.ops.tessera_qgemm.kqgemm(x.contiguous(), c.codes, c.planes, c.sup, c.sub,
                                                  self.codes_kind, self.out_features, self.in_features)
        ops = kernels.ops()
        if self.dtype == torch.bfloat16:
            return ops.linear_bf16(x, self.packed, bias, self.out_features, False, BF16_ARITHMETIC)
        if self._from_f32_blocks(x):
            return ops.linear_f32_blocks(x, self.f32_blocks, bias, self.out_features, self.f32_blocks_format,
                                         1 if self.pairs else 0)
        if self.pairs:  # the plain [.., gate | up] output
            return ops.linear_f32_pairs(x, self.packed, bias, self.out_features, False)
        return ops.linear_f32(x, self.packed, bias, self.out_features)

    def forward_silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu_mul(forward(x)) of a fused gate_up weight, bit for bit; in one pass where it is
        paired (the SiLU in the store), else the two calls."""
        if self.pairs and self._from_f32_blocks(x):
            return kernels.ops().linear_f32_blocks(x, self.f32_blocks, None, self.out_features,
                                                   self.f32_blocks_format, 2)
        if self.pairs:
            return kernels.ops().linear_f32_pairs(x, self.packed, None, self.out_features, True)
        return kernels.ops().silu_mul(self.forward(x).contiguous())

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x).float() in one pass (the logits): bf16 values rounded as forward rounds them."""
        if self.q8_codes is not None and self._from_codes(x):
            return invariant.qgemm_logits(x, *self.q8_codes, None, invariant.Q8_0, self.out_features, False)[0]
        if self.dtype == torch.bfloat16:
            return kernels.ops().linear_bf16(x, self.packed, None, self.out_features, True, BF16_ARITHMETIC)
        return self.forward(x)

    def forward_float_maxima(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(forward_float(x), each row's maximum of every 16 of those logits, NaN where one is NaN;
        None where no kernel finds them: the GGUF blocks' path, float32 weights). The bf16 kernel
        finds them in its store epilogue, so a top-k / top-p draw need not read the logits whole
        (tessera.engine.candidates.draw_kept)."""
        if self.dtype != torch.bfloat16 or x.dim() != 2 or (self.q8_codes is not None and self._from_codes(x)):
            return self.forward_float(x), None
        return tuple(kernels.ops().linear_bf16_maxima(x, self.packed, None, self.out_features, BF16_ARITHMETIC))

    def forward_float_argmax(self, x: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(forward_float(x), each row's first maximum of it, or None where no kernel finds it:
        float32 weights). The bf16 kernel finds it in its store epilogue, so greedy sampling
        need not read the logits again; with `logits` False (the caller needs only the ids) it does
        not store them either: the first is then [..., 0]."""
        if self.q8_codes is not None and self._from_codes(x):
            return invariant.qgemm_logits(x, *self.q8_codes, None, invariant.Q8_0, self.out_features, True, logits)
        if self.dtype == torch.bfloat16:
            return kernels.ops().linear_bf16_argmax(x, self.packed, None, self.out_features, BF16_ARITHMETIC, logits)
        return self.forward(x), None

    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def extra_repr(self) -> str:
        return f"invariant {self.dtype}, in_features={self.in_features}, out_features={self.out_features}"


@torch.no_grad()
def make_linears_invariant(model: nn.Module) -> int:
    """Replace the float linear weights of a loaded model by InvariantLinear; returns how many.

    Weights already quantized (a module, not a Parameter) are left alone, and so is every
    weight when no kernel exists for the model dtype here."""
    from tessera.model.layers import SwiGLUMLP
    from tessera.quant.linear import linear_weight_slots, replace_weight

    todo = []
    for owner, name, _ in linear_weight_slots(model, quantize_lm_head=True):
        weight = getattr(owner, name)
        if isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and supported(weight.dtype):
            todo.append((owner, name, weight))
    arena = memory.Arena([(packed_shape(w), w.dtype) for _, _, w in todo], huge=True)  # streamed every step
    for owner, name, weight in todo:
        pairs = type(owner) is SwiGLUMLP and name == "gate_up_proj" and pairs_layout_fits(weight)
        replace_weight(owner, name, InvariantLinear(weight, arena.take(packed_shape(weight), weight.dtype), pairs))
    count = len(todo)
    if count:
        logger.info("batch-invariant linear kernels on %d weights (%s)", count,
                    bf16_arithmetic() if model.dtype == torch.bfloat16 else "fp32")
    return count
