"""The native temperature-only draw (tessera/kernels/csrc/sampling.cpp, sample_softmax) against a
float64 inverse CDF: for every uniform u the drawn token t is the one whose cumulative
probability interval holds u (up to the float32 exps' rounding), masked tokens are never drawn,
and the sampler takes this path for temperature-only rows and keeps its torch path otherwise."""

from __future__ import annotations

import math

import pytest
import torch

from tessera import kernels
from tessera.engine.candidates import native_softmax_ops
from tessera.engine.sampler import Sampler
from tessera.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not native_softmax_ops(torch.zeros(1, 1)),
                                reason="the native sampling ops need the C++ kernels and AVX2 + FMA or AVX-512")


def _rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, vocab, generator=gen) * 3
    x[1, ::3] = float("-inf")  # masked tokens (a grammar, min_tokens)
    x[2] = x[2].bfloat16().float()  # bf16 logits: ties
    x[3, 17] = 40.0  # one token holds almost all the mass
    x[4] = torch.linspace(-5, 5, vocab)  # smooth, across chunk edges
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.25])
    return x, temperature


def _count_calls(monkeypatch, op_name: str) -> list[int]:
    """Spy on one native op: every call appends its logits' row count to the returned list."""
    calls: list[int] = []
    real = kernels.ops()
    original = getattr(real, op_name)

    def counted(*args):
        calls.append(args[0].shape[0])
        return original(*args)

    class Ops:
        def __getattr__(self, name):
            return counted if name == op_name else getattr(real, name)

    ops = Ops()
    monkeypatch.setattr(kernels, "ops", lambda: ops)
    return calls


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
    calls = _count_calls(monkeypatch, "sample_softmax")
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


def _nucleus_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(8, vocab, generator=gen)
    x[0] *= 0.5  # flat: a 0.95 nucleus of most of the row
    x[1] *= 3.0
    x[2] = (x[2] * 3).bfloat16().float()  # bf16 logits: ties across the nucleus' edge
    x[3] = (x[3] * 2).round() / 2  # heavy ties
    x[4, 17] = 40.0  # one token holds almost all the mass
    x[5, ::3] = float("-inf")  # masked tokens (a grammar, min_tokens)
    x[6] = torch.linspace(-20, 20, vocab)  # spread over every bucket, and past the last
    x[7] *= 8.0
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.25, 0.8, 1.0, 0.5])
    top_p = torch.tensor([0.95, 0.9, 0.5, 0.8, 0.3, 0.999, 0.01, 0.97])
    return x, temperature, top_p


def _nucleus_reference(row: torch.Tensor, temperature: float, top_p: float):
    """The top-p-only kept prefix in float64: quotients as torch rounds them (float32), ordered
    (quotient descending, id ascending), softmax over the whole row, a token kept while the mass
    before it is under top_p - 1e-6 (the first always). Returns (ids in order, cdf over the kept)."""
    q = (row / temperature).double()
    values, order = q.sort(descending=True, stable=True)
    probs = (values - values[0]).exp()
    probs /= probs.sum()
    threshold = float(torch.tensor(top_p) - 1e-6)
    before = probs.cumsum(0) - probs
    kept = max(1, int((before < threshold).sum()))
    return order[:kept], probs[:kept].cumsum(0)


@pytest.mark.parametrize("vocab", [1000, 4097, 49152])
def test_top_p_draw_is_the_inverse_cdf_over_the_float64_nucleus(vocab):
    x, temperature, top_p = _nucleus_rows(vocab)
    uniforms = torch.cat([torch.tensor([0.0, 1e-9, 0.5, 1 - 1e-12]),
                          torch.rand(20, generator=torch.Generator().manual_seed(5), dtype=torch.float64)])
    n = uniforms.numel()
    drawn = kernels.ops().sample_top_p(x.repeat_interleave(n, dim=0), temperature.repeat_interleave(n),
                                       top_p.repeat_interleave(n), uniforms.repeat(x.shape[0]))
    for r in range(x.shape[0]):
        ids, cdf = _nucleus_reference(x[r], float(temperature[r]), float(top_p[r]))
        position = {int(t): j for j, t in enumerate(ids)}
        for j in range(n):
            t = int(drawn[r * n + j])
            # The drawn token is in the nucleus, at the place its inverse CDF puts u (up to the
            # float32 exps' 3e-7: the last of a 0.999 nucleus may sit that close to its edge).
            assert t in position or (float(cdf[-1]) > 0.999 - 1e-5 and x[r, t] > float("-inf")), (r, j, t)
            if t not in position:
                continue
            k = position[t]
            target = float(uniforms[j]) * float(cdf[-1])
            below = float(cdf[k - 1]) if k else 0.0
            assert below - 1e-6 <= target <= float(cdf[k]) + 1e-6, (r, j, t, below, target, float(cdf[k]))
        # The last uniform reaches the nucleus' last token: the edge itself is right.
        last = int(drawn[r * n + 3])
        assert position.get(last, len(ids) - 1) >= len(ids) - 2, (r, len(ids), position.get(last))


def test_top_p_draw_equals_the_sorting_path():
    """The same uniforms through kept_prefix + draw_from_prefix (the sorting path it replaces)."""
    from tessera.engine.candidates import draw_from_prefix, kept_prefix

    x, temperature, top_p = _nucleus_rows(49152)
    rows = x.shape[0]
    for seed in range(3):
        uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        native = kernels.ops().sample_top_p(x, temperature, top_p, uniforms)
        prefix = kept_prefix(x, temperature, torch.full((rows,), 49152), top_p, torch.zeros(rows))
        assert native.tolist() == draw_from_prefix(prefix, uniforms).tolist()


def test_sampler_takes_the_native_nucleus_for_unseeded_top_p_only_rows(monkeypatch):
    x, _, _ = _nucleus_rows(4096)
    calls = _count_calls(monkeypatch, "sample_top_p")
    sampler = Sampler()
    n = x.shape[0]
    common = dict(output_token_ids=[[]] * n, prompt_token_ids=[[1]] * n)
    sampler.sample(x, [SamplingParams(temperature=0.8, top_p=0.9)] * n, generators=[None] * n, **common)
    assert calls == [n]
    # A mixed batch: only its unseeded top-p-only rows go native; every row draws from its own kept set.
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_p=0.9, top_k=5),
              SamplingParams(temperature=0.8, top_p=0.9, min_p=0.2), SamplingParams(temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.5),
              SamplingParams(temperature=0.8, top_k=2)]
    generators = [torch.Generator().manual_seed(3) if p.seed is not None else None for p in params]
    out = sampler.sample(x, params, generators=generators, **common)
    assert calls == [n, 2]
    assert out.token_ids[5] == int(x[5].argmax())
    assert out.token_ids[1] in x[1].topk(5).indices.tolist() and out.token_ids[7] in x[7].topk(2).indices.tolist()
    for r in (0, 6):
        ids, _ = _nucleus_reference(x[r], 0.8, params[r].top_p)
        assert out.token_ids[r] in ids.tolist()


@pytest.mark.parametrize("vocab", [1000, 49152])
@pytest.mark.parametrize("min_p", [0.0, 0.02, 0.3])
def test_top_p_kept_is_the_float64_nucleus_after_min_p(vocab, min_p):
    x, temperature, top_p = _nucleus_rows(vocab)
    rows = x.shape[0]
    ids, weights, num_kept = kernels.ops().top_p_kept(x, temperature, top_p, torch.full((rows,), min_p))
    for r in range(rows):
        nucleus, _ = _nucleus_reference(x[r], float(temperature[r]), float(top_p[r]))
        q = (x[r] / temperature[r]).double()
        top = float(q.max())
        # min-p after top-p: p >= min_p * p_max, i.e. at most -log(min_p) below the maximum.
        want = sorted(t for t in nucleus.tolist() if min_p == 0.0 or float(q[t]) - top >= math.log(min_p))
        n = int(num_kept[r])
        got = ids[r, :n].tolist()
        assert got == want, (r, n, len(want))  # in id order
        assert bool((weights[r, n:] == 0).all())
        # Each weight is exp(q - max): a float32 exp (within 3e-7) of the float32 difference
        # (rounded by up to half an ulp of 16 nats: 1e-6 more).
        expected = (q[ids[r, :n]] - top).exp()
        assert float(((weights[r, :n] - expected).abs() / expected).max()) < 2e-6


def test_sampler_takes_the_native_kept_set_for_seeded_and_min_p_top_p_rows(monkeypatch):
    x, _, _ = _nucleus_rows(4096)
    calls = _count_calls(monkeypatch, "top_p_kept")
    n = x.shape[0]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1),
              SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_p=0.9, top_k=3)] * 2
    generators = [torch.Generator().manual_seed(1) if p.seed is not None else None for p in params]
    out = Sampler().sample(x, params, output_token_ids=[[]] * n, prompt_token_ids=[[1]] * n, generators=generators)
    assert calls == [4]
    for r, p in enumerate(params):
        ids, _ = _nucleus_reference(x[r], 0.8, 0.9)
        top3 = x[r].sort(descending=True, stable=True).indices[:3]  # ties: the lower ids
        assert out.token_ids[r] in (top3.tolist() if p.top_k > 0 else ids.tolist())


_LANE_CASES = """
import sys, torch
from tessera import kernels
gen = torch.Generator().manual_seed(3)
x = torch.randn(6, 49157, generator=gen) * torch.tensor([0.5, 1.0, 2.0, 3.0, 6.0, 12.0])[:, None]
x[1, ::5] = float("-inf")
x[2] = x[2].bfloat16().float()
t, p = torch.tensor([1.0, 0.7, 1.3, 0.25, 0.9, 2.0]), torch.tensor([0.95, 0.5, 0.999, 0.9, 0.3, 0.97])
u = torch.rand(6, generator=gen, dtype=torch.float64)
assert kernels.available()
ops = kernels.ops()
keys = torch.tensor([[5, 9], [2**31 - 2, 0]])
torch.save([ops.sample_softmax(x, t, u), *ops.softmax_normalizers(x, t), ops.sample_top_p(x, t, p, u),
            *ops.top_p_kept(x, t, p, torch.full((6,), 0.01)), ops.seeded_uniforms(keys, None, 49157)], sys.argv[1])
"""


@pytest.mark.skipif(not {"avx512f", "avx512dq"} <= kernels.cpu_flags() or not kernels.cpu_has_avx2_fma(),
                    reason="compares the AVX-512 and AVX2 lanes: needs a CPU with both")
def test_avx2_lanes_give_the_avx512_lanes_bits(tmp_path):
    """sampling_lanes_avx2.h emulates every AVX-512 lane operation and reduction tree of
    sampling_lanes_avx512.h: the draws, normalizers, nuclei and hashed uniforms are the same bits
    (TESSERA_SAMPLING_LANES=avx2 forces the AVX2 lanes in a process of its own)."""
    import os
    import subprocess
    import sys

    results = {}
    for lanes in ("avx512", "avx2"):
        out = tmp_path / f"{lanes}.pt"
        env = dict(os.environ, TESSERA_SAMPLING_LANES=lanes)
        subprocess.run([sys.executable, "-c", _LANE_CASES, str(out)], check=True, env=env)
        results[lanes] = torch.load(out)
    for a, b in zip(results["avx512"], results["avx2"], strict=True):
        assert torch.equal(a, b)
