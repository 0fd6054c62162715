"""Gemma's RMSNorm keeps 1 + weight in float32 between calls: it must follow the weight when the
loader (or anyone) changes it in place or replaces it, and give transformers' formula either way."""

from __future__ import annotations

import pytest
import torch

from tessera.model.layers import GemmaRMSNorm


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) in float32, times (1 + w), to x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + w.float())).to(x.dtype)


def test_the_scale_follows_the_weight():
    gen = torch.Generator().manual_seed(0)
    norm = GemmaRMSNorm(64, 1e-6, torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
        first = norm(x)
        torch.testing.assert_close(first, _reference(x, norm.weight, 1e-6), rtol=0, atol=2**-6)
        norm.weight.copy_(torch.randn(64, generator=gen))  # in place: the same storage, a new version
        second = norm(x)
        torch.testing.assert_close(second, _reference(x, norm.weight, 1e-6), rtol=0, atol=2**-6)
        assert not torch.equal(first, second)
        norm.weight = torch.nn.Parameter(torch.zeros(64).bfloat16())  # replaced: another tensor
        torch.testing.assert_close(norm(x), _reference(x, norm.weight, 1e-6), rtol=0, atol=2**-6)
        norm.weight.data = torch.full((64,), 0.5).bfloat16()  # other storage, the version unchanged
        torch.testing.assert_close(norm(x), _reference(x, norm.weight, 1e-6), rtol=0, atol=2**-6)


def _native() -> bool:
    from tessera import kernels

    return kernels.available() and kernels.cpu_has_avx512_bf16()


@pytest.mark.skipif(not _native(), reason="gemma_rms_norm needs the native kernels and AVX-512 BF16")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 640), (5, 640), (3, 4, 256), (2, 37)])
def test_native_norm_is_the_formula_in_float64_rounded_once(dtype, shape):
    """fused_ops.cpp's gemma_rms_norm against x * rsqrt(mean(x^2) + eps) * (1 + w) in float64: float32
    output within float32 rounding; bf16 output the float64 value rounded (a float32 sum may move a
    value that sits near a bf16 rounding boundary by one bf16 step, never more); a row's output
    alone equals its output in the batch."""
    from tessera import kernels

    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.5).to(dtype)
    norm = GemmaRMSNorm(shape[-1], 1e-6, dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    got = norm(x)
    assert got.dtype == dtype
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.double())
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)
    else:
        step = want.abs().clamp_min(2**-100) * 2**-7  # one bf16 step at each value (upper bound)
        assert ((got.double() - want).abs() <= step).all()
        assert (got == want.to(dtype)).float().mean() > 0.95  # and almost all exactly the rounded value
    rows = x.reshape(-1, shape[-1])
    single = kernels.ops().gemma_rms_norm(rows[-1:].contiguous(), norm.scale(), 1e-6)
    assert torch.equal(single, got.reshape(-1, shape[-1])[-1:])
