"""A layer's elementwise work on CUDA as one Triton kernel each: residual add + RMSNorm, rotary,
SiLU x up.

In eager PyTorch each of these is three to six kernels (the norm: add, upcast, rms_norm,
downcast, weight multiply), and at decode sizes a GPU kernel costs its launch and ramp, not its
bytes: a 30-layer model's decode step was ~25 kernels a layer. These are the CUDA counterparts
of the CPU's fused C++ ops (tessera/kernels/csrc/fused_ops.cpp) and round where the module path
rounds (the same as Hugging Face): the sum in the model dtype, the norm in float32 rounded to the
model dtype and then scaled by the weight; cos/sin rounded to the model dtype, each half of the
rotation rounded after its first product; SiLU rounded before the multiply. Reductions and
transcendentals are the GPU's own, so the last bit may differ from the eager ops.

`usable(x)` says whether the layers should use them (a CUDA tensor of a float dtype, Triton
importable). The layers import this module only for CUDA tensors; under TRITON_INTERPRET=1 (set
before this module is first imported) the kernels also run on CPU tensors, which is how CI tests
them (tests/unit/test_triton_elementwise.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU install has no need of them
    triton = None

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def usable(x: torch.Tensor) -> bool:
    """Whether the layers should run x through these kernels: a CUDA tensor of a float dtype."""
    return triton is not None and x.is_cuda and x.dtype in _DTYPES


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n, eps, stride_x, stride_r, stride_o,
                             stride_s, HAS_RES: tl.constexpr, FP32: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
            x = x.to(out_ptr.dtype.element_ty)  # the residual stream is kept in the model dtype
            tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if FP32:
            out = xf * rstd * w
        else:  # round the normed value to the model dtype before the weight, as HF does
            out = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, stride_xt, stride_xh, stride_table,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NUM_HEADS: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
        pos = tl.load(pos_ptr + token)
        dt = out_ptr.dtype.element_ty
        # cos/sin in the model dtype, as the module path rounds its tables.
        c = tl.load(cos_ptr + pos * stride_table + dims, mask=dims < HALF, other=0.0).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_table + dims, mask=dims < HALF, other=0.0).to(dt).to(tl.float32)
        src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        # Each half: the first product rounded, then the second added in float32 (mul, then addcmul).
        o1 = ((x1 * c[None, :]).to(dt).to(tl.float32) - x2 * s[None, :]).to(dt)
        o2 = ((x2 * c[None, :]).to(dt).to(tl.float32) + x1 * s[None, :]).to(dt)
        dst = out_ptr + token * (NUM_HEADS * 2 * HALF) + heads[:, None] * (2 * HALF) + dims[None, :]
        tl.store(dst, o1, mask=mask)
        tl.store(dst + HALF, o2, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for 2-D x [T, n]; without a residual the
    second is x itself."""
    rows, n = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    summed = torch.empty_like(out) if residual is not None else x
    if rows:
        res = residual if residual is not None else x
        _add_rms_norm_kernel[(rows,)](
            x, res, weight, out, summed, n, eps, x.stride(0), res.stride(0), out.stride(0), summed.stride(0),
            HAS_RES=residual is not None, FP32=x.dtype == torch.float32, BLOCK=triton.next_power_of_2(n),
        )
    return out, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2n] holding gate then up: [T, n]."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


def rotary(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Neox rotary of x [T, heads, head_dim] (a view with contiguous head_dim) at `positions`,
    with float32 tables [max_positions, head_dim // 2]: a new contiguous tensor."""
    tokens, heads, d = x.shape
    out = torch.empty(tokens, heads, d, dtype=x.dtype, device=x.device)
    block_h = min(16, triton.next_power_of_2(heads))
    if tokens:
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, cos_table, sin_table, positions, out, x.stride(0), x.stride(1), cos_table.stride(0),
            HALF=d // 2, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d // 2), NUM_HEADS=heads,
        )
    return out
