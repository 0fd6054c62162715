"""Sampler tests against exact formulas: filters, penalties, logprobs, seeds, and the sampled
distribution (chi-square against the renormalized reference distribution)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tessera import kernels
from tessera.engine.sampler import Sampler, apply_penalties, filter_logits
from tessera.sampling import SamplingParams

EOS = 3


def sample(logits, params, outputs=None, prompts=None, generators=None, sampler=None):
    rows = logits.shape[0]
    sampler = sampler or Sampler(generator=torch.Generator().manual_seed(0))
    return sampler.sample(
        logits,
        params,
        outputs if outputs is not None else [[] for _ in range(rows)],
        prompts if prompts is not None else [[0] for _ in range(rows)],
        generators if generators is not None else [None] * rows,
        eos_token_ids={EOS},
    )


# ---- references, in float64 Python ----------------------------------------------------------


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in logits]
    return [e / sum(exps) for e in exps]


def reference_keep(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[int]:
    """Token ids kept by top-k, then top-p on the renormalized survivors, then min-p."""
    order = sorted(range(len(probs)), key=lambda t: (-probs[t], t))  # ties: lower id first
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t] for t in kept)
    nucleus, cumulative = [], 0.0
    for t in kept:
        nucleus.append(t)
        cumulative += probs[t] / mass
        if cumulative >= top_p:
            break
    p_max = probs[nucleus[0]]
    return sorted(t for t in nucleus if probs[t] >= min_p * p_max)


def kept_ids(filtered: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(filtered)).flatten().tolist()


def filter_one(logits, top_k=-1, top_p=1.0, min_p=0.0):
    vocab = logits.shape[-1]
    return filter_logits(
        logits[None],
        torch.tensor([top_k if top_k > 0 else vocab]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )[0]


def logits_from_probs(probs):
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Pearson's goodness-of-fit p-value: the chi-square(k - 1) survival function of the
    statistic, i.e. the regularized upper incomplete gamma Q((k - 1) / 2, stat / 2). Same as
    scipy.stats.chisquare (checked below when scipy is installed) without needing scipy."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    dof = len(observed) - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def test_chi_square_p_value_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    observed, expected = [18, 25, 31, 26], [25.0, 25.0, 25.0, 25.0]
    assert chi_square_p_value(observed, expected) == pytest.approx(stats.chisquare(observed, expected).pvalue, rel=1e-9)


# ---- filters -----------------------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 2.5, 0.0])
    assert kept_ids(filter_one(logits, top_k=3)) == [1, 3, 4]
    assert kept_ids(filter_one(logits, top_k=1)) == [1]
    assert kept_ids(filter_one(logits, top_k=6)) == list(range(6))


def test_top_k_with_ties_keeps_exactly_k_lower_ids_first():
    logits = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0])
    assert kept_ids(filter_one(logits, top_k=2)) == [1, 2]


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.3, [0]),  # the first token alone already reaches p
        (0.5, [0]),  # mass exactly p: the prefix stops there
        (0.5001, [0, 1]),
        (0.75, [0, 1]),
        (0.7501, [0, 1, 2]),
        (0.875, [0, 1, 2]),
        (0.99, [0, 1, 2, 3, 4]),
        (1.0, [0, 1, 2, 3, 4]),
        (1e-9, [0]),  # the top token always survives
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    probs = [0.5, 0.25, 0.125, 0.0625, 0.0625]
    assert kept_ids(filter_one(logits_from_probs(probs), top_p=top_p)) == expected


@pytest.mark.parametrize("top_p, expected", [(0.6, 2), (0.8, 3), (0.92, 4), (0.98, 5)])
def test_top_p_boundary_survives_float32_rounding(top_p, expected):
    # In float32 these prefix sums come out a hair below the decimal p, which would pull one
    # extra token into the nucleus; in exact arithmetic the prefix already reaches p.
    probs = [0.32, 0.28, 0.2, 0.12, 0.06, 0.02]
    assert kept_ids(filter_one(logits_from_probs(probs), top_p=top_p)) == list(range(expected))


def test_top_p_with_ties_keeps_the_smallest_prefix():
    logits = logits_from_probs([0.2, 0.4, 0.2, 0.2])
    assert kept_ids(filter_one(logits, top_p=0.5)) == [0, 1]  # 0.4 + one 0.2, lower id first
    assert kept_ids(filter_one(logits, top_p=0.6)) == [0, 1]
    assert kept_ids(filter_one(logits, top_p=0.61)) == [0, 1, 2]


def test_top_p_renormalizes_survivors():
    probs = [0.4, 0.3, 0.2, 0.1]
    filtered = filter_one(logits_from_probs(probs), top_p=0.65)
    assert torch.allclose(filtered.softmax(-1), torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]), atol=1e-6)


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    # After top-k=2 the survivors are 4/7 and 3/7, so p=0.5 keeps one token (without the
    # renormalization 0.4 < 0.5 would pull in a second).
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    assert kept_ids(filter_one(logits, top_k=2, top_p=0.5)) == [0]
    assert kept_ids(filter_one(logits, top_p=0.5)) == [0, 1]


def test_min_p_keeps_tokens_above_fraction_of_max():
    probs = [0.1, 0.4, 0.25, 0.15, 0.1]
    logits = logits_from_probs(probs)
    assert kept_ids(filter_one(logits, min_p=0.5)) == [1, 2]  # 0.25 >= 0.2, 0.15 < 0.2
    assert kept_ids(filter_one(logits, min_p=0.3)) == [1, 2, 3]
    tied = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert kept_ids(filter_one(tied, min_p=1.0)) == [1, 2]  # p == min_p * p_max is kept


@pytest.mark.parametrize("seed", range(6))
def test_combined_filters_match_reference_on_random_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 12, 40
    logits = torch.randn(rows, vocab, generator=gen) * 2
    top_k = torch.randint(1, vocab + 1, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.1
    min_p = torch.rand(rows, generator=gen) * 0.3
    filtered = filter_logits(logits, top_k, top_p, min_p)
    for r in range(rows):
        probs = softmax(logits[r].double().tolist())
        expected = reference_keep(probs, int(top_k[r]), float(top_p[r]), float(min_p[r]))
        assert kept_ids(filtered[r]) == expected
        assert torch.equal(filtered[r][expected], logits[r][expected])  # survivors untouched


# ---- greedy -------------------------------------------------------------------------------


def test_all_greedy_is_argmax():
    logits = torch.randn(9, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [SamplingParams(temperature=0)] * 9)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 9


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0, top_k=5, top_p=0.5),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, min_p=0.1),
        SamplingParams(temperature=0),
        SamplingParams(),
    ]
    out = sample(logits, params)
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    top3 = logits[1].topk(3).indices.tolist()
    assert out.token_ids[1] in top3


# ---- the sampled distribution ---------------------------------------------------------------

VOCAB = 16
DRAWS = 20_000
BASE_LOGITS = torch.linspace(-1.5, 1.5, VOCAB)[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))]


def empirical_counts(params: SamplingParams, per_row_generator: bool) -> list[int]:
    logits = BASE_LOGITS.expand(DRAWS, VOCAB).contiguous()
    if per_row_generator:
        # One seeded stream consumed row after row: exercises the per-row generator path.
        gen = torch.Generator().manual_seed(1234)
        out = sample(logits, [params] * DRAWS, generators=[gen] * DRAWS)
    else:
        out = sample(logits, [params] * DRAWS)
    return torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).tolist()


@pytest.mark.parametrize("per_row_generator", [False, True])
@pytest.mark.parametrize(
    "filters",
    [dict(), dict(top_k=5), dict(top_p=0.6), dict(min_p=0.3), dict(top_k=8, top_p=0.7, min_p=0.2)],
)
def test_sampled_frequencies_match_filtered_softmax(filters, per_row_generator):
    temperature = 0.7
    params = SamplingParams(temperature=temperature, **filters)
    probs = softmax([x / temperature for x in BASE_LOGITS.double().tolist()])
    kept = reference_keep(probs, filters.get("top_k", -1), filters.get("top_p", 1.0), filters.get("min_p", 0.0))
    mass = sum(probs[t] for t in kept)
    counts = empirical_counts(params, per_row_generator)

    assert sum(counts[t] for t in kept) == DRAWS  # nothing outside the filtered set, ever
    expected = [DRAWS * probs[t] / mass for t in kept]
    if len(kept) > 1:
        assert chi_square_p_value([counts[t] for t in kept], expected) > 0.001


def test_chi_square_detects_a_wrong_temperature():
    # Guards the test above: the same counts must fail against softmax at temperature 1.
    counts = empirical_counts(SamplingParams(temperature=0.7), per_row_generator=False)
    wrong = softmax(BASE_LOGITS.double().tolist())
    assert chi_square_p_value(counts, [DRAWS * p for p in wrong]) < 1e-6


# ---- seeds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mine", [SamplingParams(temperature=0.9, seed=42),
                                  SamplingParams(temperature=0.9, top_p=0.8, seed=42),  # the native kept set
                                  SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05, seed=42)],
                         ids=["temperature", "top-p", "top-p+min-p"])
def test_seeded_row_independent_of_batch_composition(mine):
    vocab = 500
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(11))

    def run(other_rows: int, other_params: SamplingParams, steps: int = 6) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        noise_gen = torch.Generator().manual_seed(other_rows)
        tokens = []
        for _ in range(steps):
            others = torch.randn(other_rows, vocab, generator=noise_gen)
            logits = torch.cat([others, row[None]])
            out = sample(
                logits,
                [other_params] * other_rows + [mine],
                generators=[None] * other_rows + [gen],
                sampler=Sampler(generator=torch.Generator().manual_seed(len(tokens) + 17)),
            )
            tokens.append(out.token_ids[-1])
        return tokens

    alone = run(0, SamplingParams())
    assert run(3, SamplingParams(temperature=0.3)) == alone
    assert run(5, SamplingParams(temperature=0)) == alone  # other rows greedy
    assert run(2, SamplingParams(top_k=4, min_p=0.1)) == alone  # other rows take the filter path
    assert run(4, SamplingParams(frequency_penalty=1.0)) == alone
    # Sanity: a different seed gives a different stream.
    gen = torch.Generator().manual_seed(43)
    other_seed = [
        sample(row[None], [dataclasses.replace(mine, seed=43)], generators=[gen]).token_ids[0] for _ in range(6)
    ]
    assert other_seed != alone


# ---- penalties --------------------------------------------------------------------------------


def naive_penalties(logits, prompt, output, repetition, presence, frequency):
    out = list(logits)
    for token in range(len(out)):
        if token in prompt or token in output:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        count = output.count(token)
        out[token] -= frequency * count + presence * (count > 0)
    return out


PENALTY_CASES = [
    (1.3, 0.0, 0.0),
    (0.7, 0.0, 0.0),
    (1.0, 0.8, 0.0),
    (1.0, 0.0, 0.6),
    (1.2, -0.5, 1.5),
    (1.0, 2.0, -2.0),
]


@pytest.mark.parametrize("repetition, presence, frequency", PENALTY_CASES)
def test_apply_penalties_matches_naive_reference(repetition, presence, frequency):
    gen = torch.Generator().manual_seed(5)
    vocab = 20
    logits = torch.randn(3, vocab, generator=gen) * 3
    prompts = [[1, 2, 2, 5], [0], []]
    outputs = [[2, 7, 7, 7, 9], [], [4, 4, 19]]
    got = apply_penalties(
        logits,
        prompts,
        outputs,
        torch.full((3,), repetition),
        torch.full((3,), presence),
        torch.full((3,), frequency),
    )
    for r in range(3):
        want = naive_penalties(logits[r].tolist(), prompts[r], outputs[r], repetition, presence, frequency)
        assert torch.allclose(got[r], torch.tensor(want), atol=1e-5)


def test_apply_penalties_equals_the_dense_formula_at_vocabulary_scale():
    # The formula over every [R, V] entry (a token never seen gets scale 1 and count 0) against
    # the sparse version, bit for bit: long prompts with repeats, a masked token, an empty row.
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 4, 49152
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[1, 100] = float("-inf")
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (300, 50, 0, 1)]
    outputs = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (120, 7, 0, 0)]
    outputs[1] += [100, 100]
    rep, pres, freq = torch.tensor([1.1, 0.8, 1.3, 1.0]), torch.tensor([0.5, -0.2, 0.0, 1.0]), torch.tensor([0.3, 1.0, 0.0, -1.0])
    counts = torch.zeros(rows, vocab)
    seen = torch.zeros(rows, vocab, dtype=torch.bool)
    for r in range(rows):
        for t in outputs[r]:
            counts[r, t] += 1
        seen[r, prompts[r] + outputs[r]] = True
    scale = torch.where(seen, rep[:, None], 1.0)
    dense = torch.where(logits > 0, logits / scale, logits * scale)
    dense = dense - freq[:, None] * counts - pres[:, None] * (counts > 0)
    got = apply_penalties(logits, prompts, outputs, rep, pres, freq)
    assert torch.equal(got, dense)
    assert not torch.equal(got, logits)  # the penalties did something
    # A token id past the vocabulary (a tokenizer larger than the lm_head) touches no logit.
    beyond = apply_penalties(logits, [p + [vocab, vocab + 5] for p in prompts], outputs, rep, pres, freq)
    assert torch.equal(beyond, dense)


def test_penalties_through_sampler_only_touch_their_rows():
    gen = torch.Generator().manual_seed(6)
    vocab = 30
    logits = torch.randn(4, vocab, generator=gen) * 3
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8]]
    outputs = [[9, 9, 10], [11], [12, 12], [13]]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0, logprobs=0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0, presence_penalty=-1.5, logprobs=0),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = sample(logits, params, outputs=outputs, prompts=prompts)
    for r, p in enumerate(params):
        want = torch.tensor(
            naive_penalties(
                logits[r].tolist(),
                prompts[r],
                outputs[r],
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
            )
        )
        token = out.token_ids[r]
        assert token == int(want.argmax())
        assert out.logprobs[r][token].logprob == pytest.approx(float(want.log_softmax(-1)[token]), abs=1e-5)


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    outputs = [[1, 1]]
    plain = sample(logits, [SamplingParams(temperature=0)], outputs=outputs)
    penalized = sample(logits, [SamplingParams(temperature=0, frequency_penalty=1.0)], outputs=outputs)
    assert plain.token_ids == [1] and penalized.token_ids == [2]  # 5 - 2*1 = 3 < 4


# ---- min_tokens -------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 2] = 8.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])
    assert sample(logits, [p], outputs=[[5, 5]]).token_ids == [2]
    assert sample(logits, [p], outputs=[[5, 5, 5]]).token_ids == [EOS]
    ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    assert sample(logits, [ignore], outputs=[[5]]).token_ids == [EOS]
    # A random row never draws a masked token either.
    hot = SamplingParams(temperature=5.0, min_tokens=1, stop_token_ids=[7])
    out = sample(logits.expand(500, 10), [hot] * 500)
    assert EOS not in out.token_ids and 7 not in out.token_ids


# ---- logprobs ---------------------------------------------------------------------------------


def naive_rank(logprobs: list[float], token: int) -> int:
    return 1 + sum(1 for x in logprobs if x > logprobs[token])


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.7])
def test_logprobs_are_raw_log_softmax_with_ranks_and_top_n(temperature):
    gen = torch.Generator().manual_seed(8)
    rows, vocab = 16, 64
    logits = torch.randn(rows, vocab, generator=gen) * 2
    n_top = [r % 6 for r in range(rows)]
    params = [SamplingParams(temperature=temperature, top_k=10, logprobs=n) for n in n_top]
    out = sample(logits, params)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for r in range(rows):
        ref = reference[r].tolist()
        token = out.token_ids[r]
        entry = out.logprobs[r]
        assert next(iter(entry)) == token  # the sampled token comes first
        assert entry[token].logprob == pytest.approx(ref[token], abs=1e-5)
        assert entry[token].rank == naive_rank(ref, token)
        top = sorted(range(vocab), key=lambda t: -ref[t])[: n_top[r]]
        assert set(entry) == set(top) | {token}
        for t in top:
            assert entry[t].logprob == pytest.approx(ref[t], abs=1e-5)
            assert entry[t].rank == naive_rank(ref, t)


def test_logprobs_zero_returns_only_sampled_token_and_none_when_unset():
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(logprobs=0), SamplingParams(), SamplingParams(logprobs=3, temperature=0)]
    out = sample(logits, params)
    assert list(out.logprobs[0]) == [out.token_ids[0]]
    assert out.logprobs[1] is None
    assert out.logprobs[2][out.token_ids[2]].rank == 1 and len(out.logprobs[2]) == 3


def test_tied_logprobs_share_the_better_rank():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0, logprobs=3)])
    ranks = {t: lp.rank for t, lp in out.logprobs[0].items()}
    assert ranks == {1: 1, 2: 1, 0: 3}


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one params/output/prompt/generator entry per logits row"):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()], [[]], [[]], [None])


def test_seeded_noise_is_exponential_and_keyed_by_its_generator():
    # The seeded race's noise (a hash of the generator's key and the token id): exp(-E) must be
    # uniform on (0, 1) (chi-square over 32 bins), neighbouring tokens uncorrelated, the stream
    # set by the generator alone, and two draws from one generator different.
    from tessera.engine.sampler import seeded_noise

    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    noise = seeded_noise(gens, 49152, torch.device("cpu"))
    assert noise.shape == (4, 49152) and bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    u = torch.exp(-noise.double()).flatten()
    counts = torch.histc(u, bins=32, min=0.0, max=1.0).tolist()
    assert chi_square_p_value(counts, [u.numel() / 32] * 32) > 0.001
    assert abs(float(noise.double().mean()) - 1.0) < 0.01  # Exponential(1) has mean 1
    lag = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(lag)) < 0.01
    again = seeded_noise([torch.Generator().manual_seed(2)], 49152, torch.device("cpu"))
    assert torch.equal(again[0], noise[2])  # the same seed, the same noise, whatever the batch
    one = torch.Generator().manual_seed(7)
    first, second = seeded_noise([one], 100, torch.device("cpu")), seeded_noise([one], 100, torch.device("cpu"))
    assert not torch.equal(first, second)


def test_seeded_noise_is_never_zero_even_at_the_top_hash_value(monkeypatch):
    # Noise 0 would make its token win the race whatever its probability: the largest hash value
    # must still give u < 1 (float32 rounding of v + 0.5 once made it exactly 1).
    import tessera.engine.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "_NATIVE_HASH", False)  # the native hash's top value: next test
    monkeypatch.setattr(sampler_mod, "_mix32_", lambda x, tmp: x.fill_(0xFFFFFFFF))
    noise = sampler_mod.seeded_noise([torch.Generator().manual_seed(0)], 8, torch.device("cpu"))
    assert bool((noise > 0).all())


@pytest.mark.skipif(not kernels.sampling_ops(torch.zeros(1)), reason="the native hash needs the C++ kernels and AVX2 + FMA or AVX-512")
def test_native_seeded_hash_equals_the_torch_integer_ops(monkeypatch):
    # seeded_uniforms (sampling.cpp, uint32 lanes) against _hashed_uniforms (torch int64 ops masked
    # to 32 bits): the same integers, so the same noise, for whole rows and for chosen tokens;
    # the chosen tokens' uniforms are exactly the whole row's, gathered.
    import tessera.engine.sampler as sampler_mod

    cpu = torch.device("cpu")

    def noise(native, token_ids=None, vocab=49157):
        monkeypatch.setattr(sampler_mod, "_NATIVE_HASH", native)
        return sampler_mod.seeded_noise([torch.Generator().manual_seed(s) for s in range(3)], vocab, cpu, token_ids)

    assert torch.equal(noise(True), noise(False))
    ids = torch.randint(0, 49157, (3, 77), generator=torch.Generator().manual_seed(1))
    assert torch.equal(noise(True, ids), noise(False, ids))
    keys = torch.tensor([[5, 9], [2**31 - 2, 0], [0, 2**31 - 2]])
    whole = kernels.ops().seeded_uniforms(keys, None, 49157)
    assert torch.equal(whole, sampler_mod._hashed_uniforms(keys, 49157, cpu, None))
    assert torch.equal(kernels.ops().seeded_uniforms(keys, ids, 0), whole.gather(1, ids))
    # u = (23 bits + 0.5) / 2^23: inside (0, 1), so the noise -log(u) is never 0.
    assert bool((whole > 0).all()) and bool((whole < 1).all())


# ---- the batch's parameter tensors, kept between calls (Sampler._row_filters) ----------------------


def _three_way_tie(rows: int, vocab: int = 300) -> torch.Tensor:
    logits = torch.full((rows, vocab), -5.0)
    logits[:, 7:10] = 2.0  # tokens 7, 8, 9 tie at the top
    return logits


def test_new_params_objects_are_not_served_the_last_batchs_filters():
    """The sampler keeps the last batch's filter tensors while the same SamplingParams objects
    come back; a batch of other objects, equal in length, must get its own: top-k 1 keeps token
    7 (ties go to the lower id), top-k 3 draws among 7, 8, 9."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    first = [SamplingParams(temperature=1.0, top_k=1, top_p=0.9) for _ in range(32)]
    assert sample(_three_way_tie(32), first, sampler=sampler).token_ids == [7] * 32
    kept = sampler._rows
    assert sample(_three_way_tie(32), first, sampler=sampler).token_ids == [7] * 32
    assert sampler._rows is kept  # the same objects: reused
    second = [SamplingParams(temperature=1.0, top_k=3, top_p=0.9) for _ in range(32)]
    tokens = sample(_three_way_tie(32), second, sampler=sampler).token_ids
    assert set(tokens) == {7, 8, 9}  # all three, as a fresh sampler draws: P(a token missing) < 3 (2/3)^32


def test_seeded_rows_after_unseeded_ones_draw_as_a_fresh_sampler():
    """The same params objects (top-p alone, which unseeded rows draw with the native nucleus) with
    generators this time: the seeded race, as a sampler that never saw the unseeded batch draws it."""
    params = [SamplingParams(temperature=1.0, top_p=0.95) for _ in range(16)]
    warm = Sampler(torch.Generator().manual_seed(1))
    sample(_three_way_tie(16), params, sampler=warm)
    seeded = [torch.Generator().manual_seed(100 + i) for i in range(16)]
    again = [torch.Generator().manual_seed(100 + i) for i in range(16)]
    got = sample(_three_way_tie(16), params, generators=seeded, sampler=warm).token_ids
    want = sample(_three_way_tie(16), params, generators=again, sampler=Sampler(torch.Generator().manual_seed(1))).token_ids
    assert got == want
