"""Greedy sampling inside the lm_head's kernel (linear_bf16_argmax): the logits are exactly
linear_bf16's fp32 output and the ids exactly torch.argmax of them (the first maximum), on both
bf16 arithmetics; the sampler takes the kernel's ids only where nothing changed the logits."""

from __future__ import annotations

import pytest
import torch

from tessera import kernels
from tessera.engine.sampler import Sampler
from tessera.kernels import linear
from tessera.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels did not build here")

ARITHMETICS = [pytest.param(0, id="avx512", marks=pytest.mark.skipif(
                   not kernels.cpu_has_avx512_bf16(), reason="needs AVX-512 BF16")),
               pytest.param(1, id="amx", marks=pytest.mark.skipif(
                   not kernels.cpu_has_amx_bf16(), reason="needs AMX bf16"))]


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4099, 576), (32, 8192, 128), (7, 1000, 64), (97, 517, 96),
                                           (0, 64, 32)])
def test_logits_and_first_maximum_match_torch(arithmetic, m, n, k, monkeypatch):
    monkeypatch.setattr(linear, "BF16_ARITHMETIC", arithmetic)
    g = torch.Generator().manual_seed(m * 7 + n)
    lin = linear.InvariantLinear(torch.randn(n, k, generator=g).bfloat16())
    x = torch.randn(m, k, generator=g).bfloat16()
    logits, ids = lin.forward_float_argmax(x)
    reference = lin.forward_float(x)
    assert torch.equal(logits, reference)
    assert ids.dtype == torch.int64 and torch.equal(ids, reference.argmax(-1))


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("rows", [40, 48])
@pytest.mark.parametrize("threads", [None, 3, 8])
def test_ties_go_to_the_first_column(arithmetic, rows, threads, monkeypatch):
    # Three copies of the same rows of weights: every maximum appears three times (in other column
    # tasks and lanes); bf16 rounding also makes ties within one copy. 48 rows: 9 column blocks,
    # three 4-block tasks (the last one short). At 8 threads the AVX-512 kernel splits the 50 rows
    # in two and the blocks four ways: a row's maximum is merged from four parts.
    monkeypatch.setattr(linear, "BF16_ARITHMETIC", arithmetic)
    w = torch.randn(rows, 64).bfloat16()
    lin = linear.InvariantLinear(torch.cat([w, w, w]))
    x = torch.randn(50, 64).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or before)
        logits, ids = lin.forward_float_argmax(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ids, logits.argmax(-1)) and bool((ids < rows).all())


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("m", [1, 32, 97])
def test_ids_without_logits_are_the_ids_with_them(arithmetic, m, monkeypatch):
    # logits=False: nothing stored ([M, 0]), the same first maxima (ties included: three copies).
    monkeypatch.setattr(linear, "BF16_ARITHMETIC", arithmetic)
    w = torch.randn(700, 96, generator=torch.Generator().manual_seed(m)).bfloat16()
    lin = linear.InvariantLinear(torch.cat([w, w, w]))
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m + 1)).bfloat16()
    logits, ids = lin.forward_float_argmax(x)
    none, alone = lin.forward_float_argmax(x, logits=False)
    assert none.shape == (m, 0) and torch.equal(alone, ids) and torch.equal(ids, logits.argmax(-1))


def test_float32_weights_give_no_kernel_argmax():
    lin = linear.InvariantLinear(torch.randn(100, 32))
    logits, ids = lin.forward_float_argmax(torch.randn(3, 32))
    assert ids is None and logits.shape == (3, 100)


def _sample(logits, params, argmax, **kw):
    n = logits.shape[0]
    return Sampler().sample(logits, params, [[] for _ in range(n)], [[1] for _ in range(n)], [None] * n,
                            argmax=argmax, **kw).token_ids


def test_the_sampler_takes_the_kernel_ids_only_for_unchanged_logits():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    marker = torch.tensor([2, 2])  # not the argmax: shows which ids a row took
    greedy = SamplingParams(temperature=0.0)
    assert _sample(logits, [greedy, greedy], marker) == [2, 2]
    # Those ids are the whole sample: logits the engine did not store ([B, 0]) are never read.
    assert _sample(torch.empty(2, 0), [greedy, greedy], marker) == [2, 2]
    assert _sample(logits, [greedy, greedy], None) == [1, 0]
    # A penalty changes the logits: the kernel's ids no longer apply.
    penalized = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert _sample(logits, [penalized, greedy], marker) == [1, 0]
    # min_tokens holding back EOS (id 1) changes row 0's logits: both rows recompute.
    held = SamplingParams(temperature=0.0, min_tokens=2)
    assert _sample(logits, [held, greedy], marker, eos_token_ids=[1]) == [2, 0]
    # takes_argmax says when the kernel's ids are the whole sample (the engine then stores no logits).
    assert Sampler.takes_argmax([greedy, greedy], [[], []])
    assert not Sampler.takes_argmax([penalized, greedy], [[], []])
    assert not Sampler.takes_argmax([held, greedy], [[], []]) and Sampler.takes_argmax([held], [[5, 6]])
    assert not Sampler.takes_argmax([SamplingParams(temperature=0.0, logprobs=0)], [[]])
    # A random row next to greedy ones: the greedy row takes the kernel's id.
    hot = SamplingParams(temperature=1.0, top_k=1)
    assert _sample(logits, [greedy, hot], marker) == [2, 0]
