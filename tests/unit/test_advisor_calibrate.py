"""Step costs fitted to observed steps (tessera/advisor/calibrate.py): the fit against exact
costs it must recover, the constrained optimum against its KKT conditions, the recorded step
compositions against a hand-worked schedule on the tiny model, and the advisor's use of the
observed slowdown. No test reads a clock: times are made from known costs."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tessera.advisor.calibrate import MIN_SAMPLES, StepRecorder, StepSample, fit_step_costs, nonnegative_lstsq
from tessera.advisor.sim import StepCosts, percentile

TRUE = StepCosts(base_s=0.025, per_decode_s=0.0017, per_prefill_token_s=0.00044, per_attention_s=2e-9)
PRIOR = StepCosts(base_s=0.06, per_decode_s=0.0035, per_prefill_token_s=0.00016, per_attention_s=1e-9,
                  source="probe")


def samples_from(costs: StepCosts, n: int = 60, seed: int = 0, slow: dict[int, float] | None = None,
                 decodes: bool = True) -> list[StepSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = rng.randint(0, 32) if decodes else 0
        p = rng.choice([0, 0, 64, 128, 256, 512]) if d else rng.choice([64, 128, 256, 512])
        pairs = p * (rng.randint(0, 512) + p / 2) + d * rng.randint(16, 600)
        t = costs.step_time(p, d, pairs) * (slow or {}).get(i, 1.0)
        out.append(StepSample(p, d, pairs, t))
    return out


def test_the_fit_recovers_exact_costs_and_trims_slowed_steps():
    slow = {3: 2.5, 17: 4.0, 40: 3.0}  # a neighbour's build slowed three steps
    fit = fit_step_costs(samples_from(TRUE, slow=slow), PRIOR)
    for name in ("base_s", "per_decode_s", "per_prefill_token_s", "per_attention_s"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    # The slowdown: the p90 of observed / modelled over every step, the slowed ones included.
    factors = [slow.get(i, 1.0) for i in range(60)]
    assert fit.slowdown == pytest.approx(max(1.0, percentile(factors, 90)))
    assert "fitted to 57 of 60" in fit.source


def test_a_machine_slower_at_times_reports_its_p90_slowdown():
    rng = random.Random(5)
    slow = {i: 1.0 + rng.random() for i in range(0, 60, 3)}  # every third step 1-2x slower
    fit = fit_step_costs(samples_from(TRUE, slow=slow), PRIOR)
    ratios = [s.time_s / fit.step_time(s.prefill_tokens, s.num_decodes, s.attention_pairs)
              for s in samples_from(TRUE, slow=slow)]
    assert fit.slowdown == pytest.approx(percentile(ratios, 90)) and fit.slowdown > 1.3


def test_too_few_samples_keep_the_prior_and_a_term_that_never_varies_keeps_its_prior():
    assert fit_step_costs(samples_from(TRUE, n=MIN_SAMPLES - 1), PRIOR) is PRIOR
    fit = fit_step_costs(samples_from(TRUE, decodes=False), PRIOR)  # prefill-only steps
    assert fit.per_decode_s == PRIOR.per_decode_s
    assert fit.base_s == pytest.approx(TRUE.base_s, rel=1e-6)
    assert fit.per_prefill_token_s == pytest.approx(TRUE.per_prefill_token_s, rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_nonnegative_lstsq_meets_the_kkt_conditions(seed):
    """x >= 0; the gradient a'(ax - y) is 0 where x > 0 and >= 0 where x = 0: the optimum."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(30, 4))
    y = a @ np.array([1.0, -2.0, 0.5, -0.1]) + 0.1 * rng.normal(size=30)  # negative truths
    x = nonnegative_lstsq(a, y)
    g = a.T @ (a @ x - y)
    assert np.all(x >= 0)
    assert np.all(np.abs(g[x > 0]) < 1e-8)
    assert np.all(g[x == 0] > -1e-8)
    assert np.any(x == 0)  # the constraint binds here


def test_the_recorder_counts_what_each_step_computed(tiny_model_dir):
    """Budget 64, no prefix caching: A's 100-token prompt takes chunks of 64 and 36, then A
    decodes beside B's 20-token prompt, then both decode. Pairs as sim.simulate counts them:
    a chunk of n from position s reads n (s + n/2), a decode at context c reads c + 1."""
    from tessera.config import EngineConfig
    from tessera.engine.engine import LLMEngine
    from tessera.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", enable_prefix_caching=False,
                                    max_num_batched_tokens=64, max_num_seqs=8, kv_cache_memory=1 << 22))
    rec = StepRecorder(engine)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(10, 110)), params)
    rec.step(), rec.step()
    engine.add_request("b", list(range(200, 220)), params)
    rec.step(), rec.step()
    got = [(s.prefill_tokens, s.num_decodes, s.attention_pairs) for s in rec.samples]
    assert got == [(64, 0, 64 * 32), (36, 0, 36 * (64 + 18)), (20, 1, 101 + 20 * 10), (0, 2, 102 + 21)]


def test_the_advisor_scores_budgets_at_the_observed_slowdown(tiny_model_factory):
    """On a machine whose steps run 2.5x slower at times, a budget that meets the ITL objective
    at 1.3x the costs but not at 2.5x is not advised: the advised one meets it at 2.5x."""
    from tessera.advisor.advise import advise
    from tessera.advisor.profile import load_model_info, profile_trace
    from tessera.advisor.sim import SimRequest, meets_slo, simulate
    from tessera.advisor.trace import synthesize
    from tessera.config import EngineConfig

    info = load_model_info(str(tiny_model_factory(max_position_embeddings=2048)), dtype="float32")
    costs = StepCosts(base_s=1e-3, per_decode_s=1e-4, per_prefill_token_s=1e-4)
    trace = synthesize("mixed", 40, rate=20.0, seed=1, vocab_size=info.config.vocab_size)
    config = EngineConfig(model=str(info.path), kv_cache_memory=1 << 26)
    slo_itl_ms = 1.35 * costs.step_time(256, 4) * 1e3

    def advised_budget(slowdown: float) -> int:
        c = StepCosts(**{**costs.__dict__, "slowdown": slowdown})
        return advise(profile_trace(trace, info, c, config, 5000, slo_itl_ms)).config["max_num_batched_tokens"]

    reqs = [SimRequest(r.arrival_time, len(r.prompt_token_ids), r.max_tokens) for r in trace]

    def itl_ok(budget: int, factor: float) -> float:
        slowed = StepCosts(costs.base_s * factor, costs.per_decode_s * factor, costs.per_prefill_token_s * factor)
        sim = simulate(reqs, slowed, budget, 64)
        return sum(meets_slo(0.0, o.itl, 1.0, slo_itl_ms / 1e3) for o in sim.outcomes) / len(sim.outcomes)

    calm, busy = advised_budget(1.0), advised_budget(2.5)
    assert busy < calm
    assert itl_ok(busy, 2.5) > itl_ok(calm, 2.5)
