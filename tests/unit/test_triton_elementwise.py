"""The CUDA elementwise kernels (tessera/kernels/triton_elementwise.py) against the module path's
torch ops, the path compared with transformers elsewhere.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (this module sets
TRITON_INTERPRET=1 before the kernels module is first imported); on a machine with CUDA they run
on the GPU (benchmarks/gpu/run.sh runs this file there). Shapes are odd on purpose (widths that
are no power of two, a strided view like the fused qkv output's).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_mode import gpu_or_interpreter

ON_GPU = gpu_or_interpreter()  # before triton is first imported

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tessera.kernels import triton_elementwise as gpu  # noqa: E402
from tessera.model.layers import RMSNorm, RotaryEmbedding, apply_rotary  # noqa: E402

if not ON_GPU and not isinstance(gpu._rotary_kernel, InterpretedFunction):
    pytest.skip("the kernels module was imported before TRITON_INTERPRET=1 could be set; run this file on its own",
                allow_module_level=True)

DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter converts float32 to bfloat16 by truncation, not rounding to nearest (numpy has
# no bfloat16), so bfloat16 is checked on a GPU only; float16's rounding points are the same.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _tol(dtype):
    # A unit in the last place where a float32 sum of squares or exp rounds the other way.
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
            torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_module_path(dtype, with_residual):
    torch.manual_seed(0)
    n = 72
    norm = RMSNorm(n, 1e-6, dtype)
    norm.weight.data.copy_(1 + 0.2 * torch.randn(n))
    x = torch.randn(5, n).to(dtype)
    residual = torch.randn(5, n).to(dtype) if with_residual else None
    # The module path's torch ops (what RMSNorm does off the fused kernels).
    summed_ref = x + residual if with_residual else x
    ref = norm._norm(summed_ref)
    out, summed = gpu.add_rms_norm(x.to(DEVICE), None if residual is None else residual.to(DEVICE),
                                   norm.weight.to(DEVICE), 1e-6)
    assert torch.equal(summed.cpu(), summed_ref)  # one rounding of the sum, as torch's add
    torch.testing.assert_close(out.cpu(), ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_module_path(dtype):
    torch.manual_seed(1)
    gate_up = (2 * torch.randn(3, 2 * 40)).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(gpu.silu_mul(gate_up.to(DEVICE)).cpu(), ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_module_path_on_a_strided_view(dtype):
    torch.manual_seed(2)
    heads, kv_heads, d, tokens = 5, 1, 32, 4
    rotary = RotaryEmbedding(d, 10000.0, None, 64)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)  # rows strided by the v part
    positions = torch.tensor([0, 7, 31, 63])
    ref = apply_rotary(qk, *rotary.cos_sin(positions, dtype))
    qk_dev = qkv.to(DEVICE)[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)  # strided there too
    out = gpu.rotary(qk_dev, rotary._cos.to(DEVICE), rotary._sin.to(DEVICE), positions.to(DEVICE))
    assert out.is_contiguous() and out.shape == qk.shape
    torch.testing.assert_close(out.cpu(), ref, **_tol(dtype))
