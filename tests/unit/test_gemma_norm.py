"""Gemma's RMSNorm keeps 1 + weight in float32 between calls: it must follow the weight when the
loader (or anyone) changes it in place or replaces it, and give transformers' formula either way."""

from __future__ import annotations

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
