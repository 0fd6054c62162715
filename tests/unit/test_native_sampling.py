"""The native temperature-only draw (tessera/kernels/csrc/sampling.cpp, sample_softmax) against a
float64 inverse CDF: for every uniform u the drawn token t is the one whose cumulative
probability interval holds u (up to the float32 exps' rounding), masked tokens are never drawn,
and the sampler takes this path for temperature-only rows and keeps its torch path otherwise."""

from __future__ import annotations

import pytest
import torch

from tessera import kernels
from tessera.engine.candidates import native_softmax_ops
from tessera.engine.sampler import Sampler
from tessera.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not native_softmax_ops(torch.zeros(1, 1)),
                                reason="the native sampling ops need the C++ kernels and AVX-512")


def _rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, vocab, generator=gen) * 3
    x[1, ::3] = float("-inf")  # masked tokens (a grammar, min_tokens)
    x[2] = x[2].bfloat16().float()  # bf16 logits: ties
    x[3, 17] = 40.0  # one token holds almost all the mass
    x[4] = torch.linspace(-5, 5, vocab)  # smooth, across chunk edges
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.25])
    return x, temperature


@pytest.mark.parametrize("vocab", [1000, 4097, 49152])
def test_draw_is_the_float64_inverse_cdf(vocab):
    x, temperature = _rows(vocab)
    uniforms = torch.cat([torch.tensor([0.0, 1e-9, 0.5, 1 - 1e-12]), torch.rand(60, generator=torch.Generator().manual_seed(3),
                                                                               dtype=torch.float64)])
    n = uniforms.numel()
    rows = x.repeat_interleave(n, dim=0)
    temps = temperature.repeat_interleave(n)
    drawn = kernels.ops().sample_softmax(rows, temps, uniforms.repeat(x.shape[0]))
    for r in range(x.shape[0]):
        p = torch.softmax(x[r].double() / float(temperature[r]), dim=-1)
        cdf = p.cumsum(0)
        for j in range(n):
            t = int(drawn[r * n + j])
            u = float(uniforms[j])
            assert p[t] > 0, (r, j, t)
            below = float(cdf[t - 1]) if t else 0.0
            assert below - 1e-5 <= u <= float(cdf[t]) + 1e-5, (r, j, t, below, u, float(cdf[t]))


def test_sampler_uses_the_native_draw_for_temperature_only_rows(monkeypatch):
    x, _ = _rows(4096)
    calls = []
    original = kernels.ops().sample_softmax

    class Ops:
        def __getattr__(self, name):
            return getattr(kernels.ops(), name)

        def sample_softmax(self, *args):
            calls.append(args[0].shape[0])
            return original(*args)

    ops = Ops()
    monkeypatch.setattr(kernels, "ops", lambda: ops)
    sampler = Sampler()
    n = x.shape[0]
    common = dict(output_token_ids=[[]] * n, prompt_token_ids=[[1]] * n)
    out = sampler.sample(x, [SamplingParams(temperature=0.8)] * n, generators=[None] * n, **common)
    assert calls == [n] and all(x[i, t] > float("-inf") for i, t in enumerate(out.token_ids))
    # min-p and seeded rows keep the torch path (the native draw has neither).
    sampler.sample(x, [SamplingParams(temperature=0.8, min_p=0.1)] * n, generators=[None] * n, **common)
    seeded = [torch.Generator().manual_seed(i) for i in range(n)]
    sampler.sample(x, [SamplingParams(temperature=0.8, seed=1)] * n, generators=seeded, **common)
    assert calls == [n]


def test_native_exp_is_within_3e_7_of_float64():
    """softmax_normalizers of rows [0, x]: the sum is 1 + exp(x), so the native exp of each x in
    [-15, 0] shows through; the docs promise each term within 3e-7 (relative) of float64's."""
    xs = torch.linspace(-15, 0, 30001)
    rows = torch.stack([torch.zeros(len(xs)), xs], 1)
    mx, total = kernels.ops().softmax_normalizers(rows, torch.ones(len(xs)))
    assert bool((mx == 0).all())
    want = xs.double().exp()
    assert float(((total - 1.0 - want).abs() / want).max()) < 3e-7
    # A masked token weighs nothing.
    _, masked = kernels.ops().softmax_normalizers(torch.tensor([[0.0, float("-inf")]]), torch.ones(1))
    assert float(masked[0]) == 1.0
