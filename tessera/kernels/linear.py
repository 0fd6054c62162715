"""Batch-invariant float linear layers: the model's weights packed once for the C++ kernels.

`InvariantLinear` computes `x @ W.T (+ bias)` with the kernels of `csrc/invariant_kernels.cpp`:
bf16 on AMX tiles (VNNI-packed weight), float32 with fixed-order FMA chains (transposed weight).
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

from tessera import kernels

logger = logging.getLogger("tessera")


def _pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> VNNI tiles [Np/16, Kp/2, 16, 2] (N, K padded to multiples of 32)."""
    n, k = weight.shape
    np_, kp = -(-n // 32) * 32, -(-k // 32) * 32
    padded = torch.zeros(np_, kp, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    return padded.view(np_ // 16, 16, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def _pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [K, Np] (transposed, N padded to a multiple of 64)."""
    n, k = weight.shape
    packed = torch.zeros(k, -(-n // 64) * 64, dtype=torch.float32)
    packed[:, :n] = weight.t()
    return packed


def supported(dtype: torch.dtype) -> bool:
    """Whether an invariant kernel exists here for weights and activations of `dtype`."""
    if not kernels.available():
        return False
    if dtype == torch.bfloat16:
        return kernels.cpu_has_amx_bf16()
    return dtype == torch.float32


class InvariantLinear(nn.Module):
    """y = x @ W.T (+ bias) with a batch-invariant kernel; W packed at construction."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if not supported(weight.dtype):
            raise ValueError(f"no batch-invariant linear kernel for {weight.dtype} on this CPU")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        pack = _pack_bf16 if weight.dtype == torch.bfloat16 else _pack_f32
        self.register_buffer("packed", pack(weight.detach()), persistent=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ops = kernels.ops()
        if self.dtype == torch.bfloat16:
            return ops.linear_amx(x, self.packed, bias, self.out_features)
        return ops.linear_f32(x, self.packed, bias, self.out_features)

    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def extra_repr(self) -> str:
        return f"invariant {self.dtype}, in_features={self.in_features}, out_features={self.out_features}"


@torch.no_grad()
def make_linears_invariant(model: nn.Module) -> int:
    """Replace the float linear weights of a loaded model by InvariantLinear; returns how many.

    Weights already quantized (a module, not a Parameter) are left alone, and so is every
    weight when no kernel exists for the model dtype here."""
    from tessera.quant.linear import linear_weight_slots, replace_weight

    count = 0
    for owner, name, _ in linear_weight_slots(model, quantize_lm_head=True):
        weight = getattr(owner, name)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or not supported(weight.dtype):
            continue
        replace_weight(owner, name, InvariantLinear(weight))
        count += 1
    if count:
        logger.info("batch-invariant linear kernels on %d weights (%s)", count,
                    "AMX bf16" if model.dtype == torch.bfloat16 else "fp32")
    return count
