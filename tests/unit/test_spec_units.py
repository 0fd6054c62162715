"""Speculative decoding pieces on their own: n-gram proposals, rejection sampling against exact
distributions (chi-square), the controller's decisions, and KV trimming."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.engine.kv_cache import KVCacheManager
from tessera.engine.request import Sequence
from tessera.engine.sampler import seeded_noise
from tessera.sampling import SamplingParams
from tessera.spec.controller import Candidate, SpeculationController, expected_tokens
from tessera.spec.ngram import NgramProposer, propose_from_tokens
from tessera.spec.rejection import rejection_sample, target_probs, verify
from tests.unit.test_sampler import chi_square_p_value

# ---- n-gram proposals ----------------------------------------------------------------------


def reference_proposal(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Brute force: longest n first, then the most recent earlier occurrence, continuation
    extended periodically past the end."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[end + j])
                return ext[length : length + k]
    return []


def test_ngram_prefers_the_longest_then_the_most_recent_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 8, 5, 2, 3]
    # "2 3" occurred ending at 3 (-> 9) and at 6 (-> 8): the most recent wins.
    assert propose_from_tokens(tokens, 2) == [8, 5]
    # "1 2 3" beats "2 3": the longer match wins though it is older.
    assert propose_from_tokens([1, 2, 3, 7, 7, 2, 3, 6, 1, 2, 3], 3) == [7, 7, 2]
    assert propose_from_tokens([4, 5, 6], 3) == []
    assert propose_from_tokens([4, 5, 6, 4], 3, min_n=2) == []


def test_ngram_extends_a_loop_periodically():
    assert propose_from_tokens([5, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert propose_from_tokens([3, 3], 4) == [3, 3, 3, 3]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 4))
def test_ngram_incremental_index_matches_brute_force(tokens, k, max_n):
    # One proposer fed the growing sequence (its index is built incrementally) must agree with
    # a brute-force search at every length.
    seq = Sequence("r", tokens[:1], SamplingParams())
    proposer = NgramProposer(max_n=max_n)
    for length in range(1, len(tokens) + 1):
        seq.output_token_ids = tokens[1:length]
        assert proposer.propose(seq, k) == reference_proposal(tokens[:length], k, max_n, 1)


# ---- rejection sampling ----------------------------------------------------------------------


def chi_square(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() * len(samples)
    assert counts[expected == 0].sum() == 0, "drew a token of probability 0"
    keep = expected > 0
    return chi_square_p_value(counts[keep].tolist(), expected[keep].tolist())


@pytest.mark.parametrize("seeded", [False, True])
def test_rejection_sampling_with_a_bad_draft_gives_the_target_distribution(seeded):
    # V = 6, k = 2. The draft q is deliberately bad (mass where p has little, none where p has
    # the most). Over 20k verifications: the first output token ~ p_0, and among those that
    # accepted x_1, the second output token ~ p_1.
    torch.manual_seed(0)
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03], [0.05, 0.05, 0.50, 0.20, 0.00, 0.20],
                      [0.10, 0.30, 0.10, 0.30, 0.10, 0.10]])
    q = torch.tensor([[0.00, 0.05, 0.05, 0.10, 0.30, 0.50], [0.60, 0.00, 0.05, 0.05, 0.20, 0.10]])
    gen = torch.Generator().manual_seed(1) if seeded else None
    draws = torch.Generator().manual_seed(2)
    proposals = torch.stack([torch.multinomial(q[j], 20_000, replacement=True, generator=draws)
                             for j in range(2)], 1).tolist()
    first, second = [], []
    accepted = 0
    for x in proposals:
        tokens, m = rejection_sample(p, x, q, gen)
        assert tokens[:m] == x[:m] and len(tokens) == m + 1
        first.append(tokens[0])
        if m >= 1:
            second.append(tokens[1])
        accepted += m
    assert chi_square(first, p[0]) > 1e-3
    assert len(second) > 2000 and chi_square(second, p[1]) > 1e-3
    # The acceptance rate of the first proposal is sum_x min(p, q) (the optimum).
    assert abs(len(second) / 20_000 - float(torch.minimum(p[0], q[0]).sum())) < 0.02


def test_point_mass_proposals_give_the_target_distribution():
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03], [0.05, 0.05, 0.50, 0.20, 0.00, 0.20]])
    torch.manual_seed(3)
    first, accepted = [], 0
    for _ in range(20_000):
        tokens, m = rejection_sample(p, [1], None, None)  # always proposes token 1
        first.append(tokens[0])
        accepted += m
    assert chi_square(first, p[0]) > 1e-3
    assert abs(accepted / 20_000 - 0.25) < 0.02  # accepted with probability p_0(x)


def test_point_mass_verification_reproduces_plain_seeded_sampling():
    # A seeded generator gives the same tokens (and ends in the same state) as plain decoding
    # drawing one row of exponential noise per token (the sampler's seeded_noise).
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 50) * 2, -1)
    for seed in range(30):
        plain = torch.Generator().manual_seed(seed)
        expected = []
        for j in range(4):
            noise = seeded_noise([plain], 50, torch.device("cpu"))[0]
            expected.append(int((p[j] / noise).argmax()))
        proposal = expected[:2] + [(expected[2] + 1) % 50]  # two right, the third wrong
        gen = torch.Generator().manual_seed(seed)
        tokens, m = rejection_sample(p, proposal, None, gen)
        assert m == 2 and tokens == expected[:3]
        after = torch.Generator().manual_seed(seed)
        for _ in range(3):
            seeded_noise([after], 50, torch.device("cpu"))
        assert torch.equal(gen.get_state(), after.get_state())


def test_verify_greedy_takes_the_longest_matching_prefix():
    logits = torch.full((7, 5), -1.0)
    for row, best in enumerate([2, 3, 1, 0, 4, 4, 1]):
        logits[row, best] = 1.0
    greedy = SamplingParams(temperature=0)
    out = verify(logits, [[2, 3, 4], [4, 4]], [greedy, greedy], [0, 0], [None, None])
    # seq 0: rows 0..3 argmax 2 3 1 0: accepts 2, 3, rejects 4 -> bonus 1
    # seq 1: rows 4..6 argmax 4 4 1: accepts 4, 4 -> bonus 1
    assert out.token_ids == [[2, 3, 1], [4, 4, 1]] and out.num_accepted == [2, 2]


def test_verify_applies_min_tokens_per_row():
    # EOS (token 0) is the argmax everywhere; min_tokens=2 with 1 output token so far masks it
    # at row 0 (output length 1) only.
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 0.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2)
    out = verify(logits, [[1]], [params], [1], [None], eos_token_ids={0})
    assert out.token_ids == [[1, 0]]


def test_target_probs_match_the_sampler_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    probs = target_probs(logits, [SamplingParams(temperature=0.5, top_k=2)])[0]
    kept = torch.softmax(torch.tensor([4.0, 2.0]), -1)
    assert torch.allclose(probs, torch.tensor([kept[0], kept[1], 0, 0, 0]))


# ---- controller ------------------------------------------------------------------------------


def feed(controller: SpeculationController, batch: int, accept: float, plain_s: float, extra_s_per_token: float,
         steps: int, rng: random.Random, span_s: float = 0.002) -> list[int]:
    """Run the controller against a simulated machine (a speculating sequence adds span_s plus
    extra_s_per_token per proposal) and acceptance; return the largest k of each step."""
    ks = []
    for _ in range(steps):
        plan = controller.choose([Candidate(i, controller.max_k, "key") for i in range(batch)], batch)
        for k in plan.values():
            m = 0
            while m < k and rng.random() < accept:
                m += 1
            controller.record_verification("key", k, m)
        seconds = plain_s + sum(span_s + extra_s_per_token * k for k in plan.values())
        controller.record_step(batch, len(plan), seconds)
        ks.append(max(plan.values(), default=0))
    return ks


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_controller_speculates_when_acceptance_is_high_and_the_batch_small():
    controller = SpeculationController(max_k=6)
    ks = feed(controller, 1, accept=0.9, plain_s=0.030, extra_s_per_token=0.001, steps=60, rng=random.Random(0))
    assert all(k >= 4 for k in ks[-20:])


def test_controller_finds_a_large_k_when_small_ones_do_not_pay():
    # This CPU's shape: one extra token costs 2/3 of a decode, eight cost little more.
    controller = SpeculationController(max_k=8)
    rng = random.Random(0)
    ks = []
    for _ in range(60):
        plan = controller.choose([Candidate(0, 8, "key")], 1)
        k = plan.get(0, 0)
        if k:
            m = 0
            while m < k and rng.random() < 0.8:
                m += 1
            controller.record_verification("key", k, m)
        controller.record_step(1, len(plan), 0.075 + (0.050 + 0.004 * k if k else 0.0))
        ks.append(k)
    assert sum(k >= 7 for k in ks[-30:]) >= 28


def test_controller_switches_off_under_low_acceptance_and_large_batches():
    rng = random.Random(0)
    low = SpeculationController(max_k=6)
    ks = feed(low, 1, accept=0.05, plain_s=0.030, extra_s_per_token=0.004, steps=300, rng=rng)
    # The first probes, then retries every 8, 16, 32... steps (about 6 in 300 steps; retries
    # that never backed off would be 37).
    assert sum(k > 0 for k in ks) <= 16
    # Batch 16 on a machine where each speculating sequence costs about as much as a decode.
    big = SpeculationController(max_k=6)
    ks = feed(big, 16, accept=0.5, plain_s=0.040, extra_s_per_token=0.008, steps=300, rng=rng)
    assert sum(k > 0 for k in ks) <= 8


def test_controller_comes_back_on_when_acceptance_recovers():
    rng = random.Random(1)
    controller = SpeculationController(max_k=6)
    feed(controller, 1, accept=0.05, plain_s=0.030, extra_s_per_token=0.002, steps=100, rng=rng)
    ks = feed(controller, 1, accept=0.95, plain_s=0.030, extra_s_per_token=0.002, steps=400, rng=rng)
    assert all(k >= 3 for k in ks[-50:])


def test_a_key_dropped_after_one_rejection_is_retried_soon_and_comes_back():
    # Batch 1 on this CPU: a plain step 68 ms, a verification of 4 tokens 75 ms more. A fresh
    # match length (prior 0.3) is rejected once: 0.13, plus one standard error 0.30, pays at no k.
    key, group = ("r", 0, 2), ("match", 2)
    cand = Candidate(0, 8, key, group, 0.3)

    def run(controller, steps, accepted, batch=1):  # accepted(k): proposals the verification accepts
        ks = []
        for _ in range(steps):
            k = controller.choose([cand], batch).get(0, 0)
            if k:
                controller.record_verification(key, k, accepted(k))
            controller.record_step(batch, 1 if k else 0, 0.068 + (0.075 if k else 0.0))
            ks.append(k)
        return ks

    def after_one_rejection(batch=1):
        controller = SpeculationController(max_k=8)
        assert controller.choose([cand], batch) == {}  # step 1: no plain step measured yet
        controller.record_step(batch, 0, 0.068)
        controller.costs(batch).extra[4] = 0.075
        controller.record_verification(key, 8, 0)
        assert controller.optimistic_acceptance(key) == pytest.approx(0.3033, abs=1e-4)
        return controller

    # Still rejected: retried at 2 tokens on steps 9, 17, 33 (every 8 steps, then backing off),
    # within a 128-token request (retries every 256 steps never came).
    ks = run(after_one_rejection(), 58, lambda k: 0)
    assert [step for step, k in enumerate(ks, 2) if k] == [9, 17, 33] and set(ks) == {0, 2}
    # Accepted in full at the retry: the optimizer takes it from there at the largest k.
    ks = run(after_one_rejection(), 28, lambda k: k)
    assert ks == [0] * 7 + [2] + [8] * 20
    # Intervals count steps per sequence of the batch: at batch 2 (same costs) every 16 steps.
    ks = run(after_one_rejection(batch=2), 68, lambda k: 0, batch=2)
    assert [step for step, k in enumerate(ks, 2) if k] == [17, 33, 65]


def test_fixed_mode_always_speculates_k():
    controller = SpeculationController(max_k=3, adaptive=False)
    plan = controller.choose([Candidate(0, 3, "a"), Candidate(1, 3, "a"), Candidate(2, 2, "b")], 4)
    assert plan == {0: 3, 1: 3, 2: 2}


def test_costs_not_measured_are_read_off_the_measured_ones():
    controller = SpeculationController(max_k=8)
    costs = controller.costs(1)
    assert costs.extra_cost(3) is None
    costs.extra.update({2: 0.010, 6: 0.030})
    assert costs.extra_cost(1) == 0.010 and costs.extra_cost(8) == 0.030
    assert costs.extra_cost(4) == pytest.approx(0.020)


# ---- KV trim -----------------------------------------------------------------------------------


def test_trim_frees_blocks_past_the_kept_tokens():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    seq = Sequence("r", list(range(10)), SamplingParams())
    assert kv.allocate_for_admission(seq, 10)
    seq.num_computed_tokens = 10
    kv.commit_computed(seq)
    assert kv.allocate_slots(seq, 1 + 8)  # a verification of 8 proposals: 19 positions, 5 blocks
    assert len(seq.block_table) == 5
    seq.output_token_ids = [1, 2, 3]  # 2 proposals accepted + the target's token
    seq.num_computed_tokens = 12
    kv.commit_computed(seq)
    kv.trim(seq, seq.num_tokens)
    assert len(seq.block_table) == 4  # 13 tokens
    kv.check_invariants([seq])
    assert kv.num_free_blocks == 19 - 4
    with pytest.raises(AssertionError):
        kv.trim(seq, 11)  # would drop computed K/V
    kv.free(seq)
    kv.check_invariants([])


def test_a_key_starts_from_its_group_and_then_learns_its_own_rate():
    controller = SpeculationController(max_k=4)
    for seq_id in range(5):  # other requests: their short matches were all rejected
        controller.choose([Candidate(seq_id, 4, ("r", seq_id), "short", 0.5)], 1)
        for _ in range(10):
            controller.record_verification(("r", seq_id), 4, 0)
    assert controller.acceptance("short") < 0.1
    new = Candidate(9, 4, ("r", 9), "short", 0.5)
    controller.choose([new], 1)
    assert controller.acceptance(new.key) < 0.1  # a new request inherits the group's estimate
    for _ in range(10):  # but this one is copying: its short matches are accepted
        controller.record_verification(new.key, 4, 4)
    assert controller.acceptance(new.key) > 0.8
    controller.forget(9)
    assert ("r", 9) not in controller._acceptance and "short" in controller._acceptance
