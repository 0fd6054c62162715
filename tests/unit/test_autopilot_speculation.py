"""The autopilot's speculation knob: the shadow n-gram replay against a naive replay, the
speedup model against its formula, decisions from fed acceptance counts (step costs injected,
never timed), the tiny model turning speculation on where its outputs repeat and off where they
are random, the engine's set_speculation, and the decision records and their counter."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tessera.advisor.autopilot import Autopilot, AutopilotConfig, Decision
from tessera.advisor.profile import ngram_acceptance
from tessera.advisor.sim import StepCosts
from tessera.advisor.spec_pilot import ShadowNgram, best_k, speedup
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.sampling import SamplingParams

# Verification is cheap next to a decode step (as on a CPU, where a prompt token in a chunk
# costs a small share of a step): speculation pays wherever drafts are accepted.
CHEAP_VERIFY = StepCosts(base_s=0.010, per_decode_s=0.0, per_prefill_token_s=0.0002, source="injected")


def copy_with_edits(rng: random.Random, prompt: list[int], edits: int) -> list[int]:
    out = list(prompt)
    for _ in range(edits):
        at = rng.randrange(len(out))
        out[at : at + 3] = [rng.randrange(5000, 6000) for _ in range(3)]
    return out


def test_shadow_replay_counts_what_a_naive_replay_counts():
    """On outputs that copy a random prompt with edits (no loops, where the two proposers agree),
    the online replay matches profile.ngram_acceptance with its naive proposer."""
    rng = random.Random(1)
    shadow = ShadowNgram(k=6)
    totals = [0, 0, 0, 0]
    for i in range(5):
        prompt = [rng.randrange(100, 5000) for _ in range(200)]
        output = copy_with_edits(rng, prompt, 4)
        shadow.start(f"r{i}", prompt)
        pos = 0
        while pos < len(output):  # arbitrary delta sizes, as speculative steps deliver them
            n = rng.randint(1, 5)
            shadow.extend(f"r{i}", output[pos : pos + n])
            pos += n
        shadow.finish(f"r{i}")
        ref = ngram_acceptance(prompt, output, k=6, use_engine_proposer=False)
        totals = [t + r for t, r in zip(totals, ref, strict=True)]
    w = shadow.take()
    assert (w.steps, w.drafted, w.proposed, w.accepted) == tuple(totals)
    assert w.tokens == 5 * 200 and w.acceptance > 0.8


def test_speedup_is_the_formula():
    a, f, k, b, t, c = 0.6, 0.5, 3, 4, 0.02, 0.001
    expected = (1 + f * ((1 + a + a * a + a ** 3) - 1)) * t / (t + b * f * k * c)
    assert speedup(a, f, k, b, t, c) == pytest.approx(expected)
    assert best_k(0.0, 1.0, 8, 1, t, c)[1] < 1.0  # nothing accepted: every k costs
    assert best_k(0.95, 1.0, 8, 1, t, c)[0] == 8  # nearly everything: the longest draft


def feed(ap: Autopilot, rng: random.Random, copying: bool, n: int = 4) -> None:
    for i in range(n):
        prompt = [rng.randrange(100, 5000) for _ in range(160)]
        output = copy_with_edits(rng, prompt, 2) if copying else [rng.randrange(100, 5000) for _ in range(160)]
        ap.record_output(f"{copying}-{i}", prompt, output[:1])
        ap.record_output(f"{copying}-{i}", None, output[1:], finished=True)
        ap.record_spec_measured(0, 0, batch=4)


def test_decisions_from_fed_acceptance_turn_speculation_on_and_off():
    ap = Autopilot(AutopilotConfig(step_costs=CHEAP_VERIFY, spec_window_tokens=512), enable_prefix_caching=True,
                   max_num_batched_tokens=512, speculative_method=None, num_speculative_tokens=4)
    rng = random.Random(0)
    feed(ap, rng, copying=True, n=2)
    assert ap.decide(1.0) == []  # 320 tokens: the window is not full
    feed(ap, rng, copying=True, n=2)
    on = ap.decide(2.0)
    assert [(d.knob, d.old, d.new) for d in on] == [("speculative_method", None, "ngram"),
                                                    ("num_speculative_tokens", 4, 8)]
    fig = on[0].figures
    assert fig["acceptance"] > 0.9 and fig["best_k"] == 8 and fig["best_speedup"] >= 1.15
    assert fig["plain_step_s"] == pytest.approx(0.010) and fig["costs"] == "injected"
    assert "modelled speedup" in on[0].reason and ap.spec_method == "ngram" and ap.spec_k == 8
    feed(ap, rng, copying=False, n=4)  # random text: no draft is accepted
    (off,) = ap.decide(3.0)
    assert (off.knob, off.old, off.new) == ("speculative_method", "ngram", None)
    assert off.figures["acceptance"] < 0.05 and off.figures["best_speedup"] < 1.0
    assert "does not pay" in off.reason and ap.spec_method is None
    feed(ap, rng, copying=False, n=4)
    assert ap.decide(4.0) == []  # stays off
    assert [d.knob for d in ap.decisions()] == ["speculative_method", "num_speculative_tokens", "speculative_method"]


def test_expensive_verification_keeps_speculation_off_on_the_same_text():
    """Where a draft token costs as much as a decode step, even copying does not pay at batch 4."""
    costly = StepCosts(base_s=0.010, per_decode_s=0.0, per_prefill_token_s=0.010, source="injected")
    ap = Autopilot(AutopilotConfig(step_costs=costly, spec_window_tokens=512), enable_prefix_caching=True,
                   max_num_batched_tokens=512)
    feed(ap, random.Random(0), copying=True, n=4)
    assert ap.decide(1.0) == [] and ap.spec_method is None and ap.last_spec["best_speedup"] < 1.15


def test_no_decision_before_a_step_is_measured():
    ap = Autopilot(AutopilotConfig(spec_window_tokens=100), enable_prefix_caching=True, max_num_batched_tokens=512)
    feed(ap, random.Random(0), copying=True, n=2)
    assert ap.decide(1.0) == []  # no step costs yet: the window keeps counting
    ap.record_step(0.0, 0, 0.010)  # a decode-only step
    ap.record_step(0.0, 64, 0.010 + 64 * 0.0002)  # a step with a 64-token prefill chunk
    (on, _) = ap.decide(2.0)
    assert on.new == "ngram" and on.figures["costs"] == "live steps"
    assert on.figures["per_draft_token_s"] == pytest.approx(0.0002)


# ---- on the tiny model ------------------------------------------------------------------------------


def engine_for(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, num_threads=1,
                                  kv_cache_memory=1 << 21, **kw))


def run(engine: LLMEngine, prompts, params_of, ap: Autopilot | None = None) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params_of(i))
    done, clock = {}, 0.0
    while engine.has_unfinished_requests():
        outs = engine.step()
        engine.check_invariants()
        clock += 0.01
        if ap is not None:
            ap.on_step(outs, engine.stats(), clock)
        done.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    return done


def prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(24)] for _ in range(n)]


def test_tiny_model_greedy_outputs_repeat_and_the_autopilot_turns_speculation_on(tiny_model_dir):
    """Greedy decoding of the random tiny model falls into loops the n-gram proposer predicts:
    speculation goes on mid-run, verifies drafts, and leaves every output as it was."""
    greedy = lambda i: SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)  # noqa: E731
    reference = run(engine_for(tiny_model_dir), prompts(5), greedy)
    engine = engine_for(tiny_model_dir)
    ap = Autopilot.for_engine(engine, AutopilotConfig(step_costs=CHEAP_VERIFY, spec_window_tokens=96))
    assert ap.spec_method is None
    assert run(engine, prompts(5), greedy, ap) == reference
    first = ap.decisions()[0]
    assert (first.knob, first.new) == ("speculative_method", "ngram") and first.figures["acceptance"] > 0.3
    assert engine.spec is not None and engine.spec.max_k == ap.spec_k
    assert engine.stats().spec_num_accepted_tokens > 0  # it really speculated after the switch


def test_tiny_model_random_samples_turn_speculation_off(tiny_model_dir):
    """Sampled at temperature 1 the same model's outputs are close to uniform over its 267
    tokens: drafts are rejected, and speculation that was on goes off."""
    sampled = lambda i: SamplingParams(max_tokens=96, temperature=1.0, ignore_eos=True, seed=i)  # noqa: E731
    engine = engine_for(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=4)
    ap = Autopilot.for_engine(engine, AutopilotConfig(step_costs=CHEAP_VERIFY, spec_window_tokens=96))
    assert (ap.spec_method, ap.spec_k) == ("ngram", 4)
    run(engine, prompts(6), sampled, ap)
    knobs = [(d.knob, d.old, d.new) for d in ap.decisions()]
    assert ("speculative_method", "ngram", None) in knobs and ap.spec_method is None
    assert engine.spec is None
    off = next(d for d in ap.decisions() if d.knob == "speculative_method")
    assert off.figures["acceptance"] < 0.2 and off.figures["best_speedup"] < 1.0


def test_set_speculation_keeps_counters_and_outputs(tiny_model_dir):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reference = run(engine_for(tiny_model_dir), prompts(7), lambda i: greedy)
    engine = engine_for(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=3)
    for i, p in enumerate(prompts(7)):
        engine.add_request(f"r{i}", p, greedy)
    done, step, seen = {}, 0, []
    while engine.has_unfinished_requests():
        if step in (6, 14, 20):
            engine.set_speculation({6: None, 14: "ngram", 20: "ngram"}[step], {14: 5, 20: 2}.get(step))
        outs = engine.step()
        engine.check_invariants()
        seen.append(engine.stats().spec_num_proposed_tokens)
        done.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
        step += 1
    assert done == reference
    assert seen == sorted(seen) and seen[-1] > 0  # monotonic across the switches
    assert engine.spec.max_k == 2 and engine.spec.controller.max_k == 2
    with pytest.raises(ValueError, match="only 'ngram'"):
        engine.set_speculation("draft")


def test_decision_records_are_counted_by_knob():
    ap = Autopilot(AutopilotConfig(step_costs=CHEAP_VERIFY, spec_window_tokens=512), enable_prefix_caching=True,
                   max_num_batched_tokens=512)
    feed(ap, random.Random(0), copying=True)
    ap.decide(1.0)
    assert all(isinstance(d, Decision) and d.reason and d.figures for d in ap.decisions())
    registry = CollectorRegistry()
    registry.register(ap.collector("m"))
    text = generate_latest(registry).decode()
    assert 'tessera:autopilot_decisions_total{knob="speculative_method",model_name="m"} 1.0' in text
    assert 'tessera:autopilot_decisions_total{knob="num_speculative_tokens",model_name="m"} 1.0' in text
    assert 'tessera:autopilot_decisions_total{knob="enable_prefix_caching",model_name="m"} 0.0' in text
    assert 'tessera:autopilot_speculative_tokens{model_name="m"} 8.0' in text
