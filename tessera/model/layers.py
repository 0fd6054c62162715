"""Building blocks of a Llama-family decoder: RMSNorm, rotary position embedding, SwiGLU MLP.

Each block computes exactly what Hugging Face transformers computes (same rounding points in
bf16), so parity tests can compare logits to 1e-4 in float32. Weights are plain parameters
filled by `LlamaForCausalLM.load_weights`; nothing here is randomly initialised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tessera import kernels


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor | nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a float weight; a quantized weight (a tessera.quant QuantLinear that
    `quantize_model` put in the parameter's place) runs its own kernel."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight(x, bias)


def embedding(input_ids: torch.Tensor, table: torch.Tensor | nn.Module) -> torch.Tensor:
    """F.embedding for a float table; a quantized table (gguf mode's QuantEmbedding) looks the
    rows up in its blocks."""
    if isinstance(table, torch.Tensor):
        return F.embedding(input_ids, table)
    return table(input_ids)


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add.

    `forward(x)` returns the normed x. `forward(x, residual)` first adds (x + residual, in the
    model dtype, as HF does) and returns `(normed, new_residual)`, saving one pass per layer.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = _empty_param(hidden_size, dtype=dtype, device=device)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        # HF normalises in fp32, rounds to the model dtype, then scales by the weight.
        normed = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps).to(x.dtype)
        return normed * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if kernels.fused(x) and x.is_contiguous() and x.dtype == self.weight.dtype:
            # One pass (tessera/kernels/csrc/fused_ops.cpp), the same rounding points.
            normed, summed = kernels.ops().add_rms_norm(x, residual, self.weight, self.eps)
            return normed if residual is None else (normed, summed)
        if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and x.dtype == self.weight.dtype:
            from tessera.kernels import triton_elementwise as gpu  # one kernel, not five

            if gpu.usable(x):
                normed, summed = gpu.add_rms_norm(x, residual, self.weight, self.eps)
                return normed if residual is None else (normed, summed)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")


def rope_inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None,
                             max_position_embeddings: int = 2048) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] float32, cos/sin scale) for the rope types HF calls
    default, linear, llama3, dynamic and yarn; anything else (longrope...) is refused clearly.

    dynamic (NTK): transformers keeps the unscaled frequencies up to max_position_embeddings and
    rescales the base past it; tessera caps max_model_len there, so the unscaled ones are exact.
    yarn: frequencies blended between interpolated and extrapolated by a linear ramp over the
    dimensions, and cos/sin scaled by the attention factor, as transformers computes them.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq, 1.0
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, rope_scaling, max_position_embeddings)
    raise NotImplementedError(
        f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)}); "
        "remove rope_scaling from the model's config.json or pick another model"
    )


def _yarn(dim: int, theta: float, scaling: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a cos/sin table indexed by position.

    The table is float32 and grows on demand, so positions past max_position_embeddings work.
    `cos_sin(positions, dtype)` is computed once per forward and shared by every layer.
    """

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict | None,
        max_position_embeddings: int,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.head_dim = head_dim
        inv_freq, self.attention_scaling = rope_inverse_frequencies(head_dim, rope_theta, rope_scaling,
                                                                    max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._cos = torch.empty(0, head_dim // 2, device=device)
        self._sin = torch.empty(0, head_dim // 2, device=device)
        self._grow(max_position_embeddings)

    def _grow(self, num_positions: int) -> None:
        device = self.inv_freq.device
        if device.type == "meta":  # a model laid out before its weights load: shapes only
            self._cos = self._sin = torch.empty(num_positions, self.head_dim // 2, device=device)
            return
        t = torch.arange(num_positions, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.cpu())  # same angles as HF's inv_freq @ positions in fp32
        # cos and sin of those angles in float64 (numpy, one thread), rounded once: the correctly
        # rounded table, the same in every process. torch's float32 cos is not: in about one engine
        # in 40 built in a pytest process after other kernel tests, half of the table's cos entries
        # differed from every other engine's (docs/kernels.md, "Session 28"), and so did its logprobs.
        angles = freqs.double().numpy()
        cos = torch.from_numpy(np.cos(angles)).float().to(device)
        sin = torch.from_numpy(np.sin(angles)).float().to(device)
        if self.attention_scaling != 1.0:  # yarn scales cos and sin, as transformers does
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        self._cos, self._sin = cos, sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's position: [T, 1, head_dim // 2] in `dtype`."""
        self._cover(positions)
        cos = self._cos.index_select(0, positions).unsqueeze(1)
        sin = self._sin.index_select(0, positions).unsqueeze(1)
        return cos.to(dtype), sin.to(dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAt:
        """The rotation of this step's tokens, applied to each layer's q and k by `RopeAt.apply`."""
        self._cover(positions)
        return RopeAt(self, positions, dtype)

    def _cover(self, positions: torch.Tensor) -> None:
        # Reading the largest position syncs with the device, which a CUDA graph's capture may
        # not do; the graph runner grows the tables to max_model_len before it captures.
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if positions.numel() and int(positions.max()) >= self._cos.shape[0]:
            self._grow(max(int(positions.max()) + 1, 2 * self._cos.shape[0]))


@dataclass
class RopeAt:
    """A rotary embedding at one step's positions. `apply` uses the fused C++ op on CPU (it
    reads the fp32 tables at each position) and the cos/sin tensors otherwise, built once."""

    rotary: RotaryEmbedding
    positions: torch.Tensor
    dtype: torch.dtype
    _cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] (a view whose heads are contiguous, e.g. into the fused
        qkv output); returns a new contiguous [T, heads, head_dim] tensor."""
        t, heads, d = x.shape
        if kernels.fused(x) and x.stride(2) == 1 and x.stride(1) == d and self.positions.dtype == torch.long:
            rows = x.as_strided((t, heads * d), (x.stride(0), 1))
            return kernels.ops().rotary(rows, self.rotary._cos, self.rotary._sin, self.positions.contiguous(), heads, d)
        if x.is_cuda and x.stride(2) == 1 and d % 2 == 0:
            from tessera.kernels import triton_elementwise as gpu  # one kernel, not four

            if gpu.usable(x):
                return gpu.rotary(x, self.rotary._cos, self.rotary._sin, self.positions)
        if self._cos_sin is None:
            self._cos_sin = self.rotary.cos_sin(self.positions, self.dtype)
        return apply_rotary(x, *self._cos_sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, n_heads, head_dim] (may be a strided view) by cos/sin [T, 1, head_dim // 2].

    Equals HF's `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`; returns a new
    contiguous tensor.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2 * intermediate, hidden] weight."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = _empty_param(2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.down_proj = _empty_param(hidden_size, intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "pairs", False):  # float32, paired: the SiLU in the linear's store
            return linear(self.gate_up_proj.forward_silu(x), self.down_proj)
        gate_up = linear(x, self.gate_up_proj)
        if kernels.fused(gate_up) and gate_up.is_contiguous():
            return linear(kernels.ops().silu_mul(gate_up), self.down_proj)  # one pass, same rounding
        if gate_up.is_cuda and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            from tessera.kernels import triton_elementwise as gpu

            if gpu.usable(gate_up):
                return linear(gpu.silu_mul(gate_up), self.down_proj)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalise and scale by (1 + weight), both in float32, then round to the
    input dtype (Llama rounds before scaling by the weight; Gemma after)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = _empty_param(hidden_size, dtype=dtype, device=device)
        self._scale: torch.Tensor | None = None
        # what it was made from: the weight tensor, its storage and its version (an in-place change
        # bumps the version, `.data =` changes the storage, an assignment the tensor)
        self._scale_of: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.bfloat16) and kernels.fused(x) and kernels.cpu_has_avx512_bf16():
            # One native pass (fused_ops.cpp: gemma_rms_norm), the same formula with its own float32
            # sum of squares: ~1 us a 640-wide row against ~17 us of torch ops (108 a decode step).
            return kernels.ops().gemma_rms_norm(x.contiguous(), self.scale(), self.eps)
        normed = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps)
        return (normed * self.scale()).to(x.dtype)

    def scale(self) -> torch.Tensor:
        """1 + weight in float32, made again only when the weight changes (loaded or replaced after
        construction): a Gemma 3 270M decode step runs 108 of these norms, and the cast and add
        per call were ~5 of its ~21 us."""
        w = self.weight
        made = self._scale_of
        if made is None or made[0] is not w or made[1:] != (w.data_ptr(), w._version):
            self._scale, self._scale_of = 1.0 + w.float(), (w, w.data_ptr(), w._version)
        return self._scale


class GeGLUMLP(SwiGLUMLP):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's MLP, laid out as SwiGLUMLP (fused gate_up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return linear(F.gelu(gate, approximate="tanh") * up, self.down_proj)
