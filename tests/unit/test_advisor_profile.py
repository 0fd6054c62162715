"""The six measurements of `tessera profile`, on inputs whose right answer is known by construction,
and the scheduler simulation they rest on."""

from __future__ import annotations

import random

import pytest
from safetensors import safe_open

import tessera.advisor.profile as profile_module
from tessera.advisor.profile import (
    heterogeneity_profile,
    load_model_info,
    ngram_acceptance,
    prefix_profile,
    profile_trace,
    speculation_profile,
)
from tessera.advisor.sim import SimRequest, StepCosts, simulate, simulate_disaggregated, simulate_replicas
from tessera.advisor.trace import synthesize
from tessera.config import EngineConfig

COSTS = StepCosts(base_s=1e-3, per_decode_s=1e-4, per_prefill_token_s=2e-5)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


# ---- 1. memory ---------------------------------------------------------------------------------


def test_weights_and_kv_bytes_match_the_model_files(tiny_model_dir):
    info = load_model_info(str(tiny_model_dir), dtype="float32")
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
        numel = sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                    else _prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert info.num_params() == numel
    c = info.config
    assert info.kv_bytes_per_token() == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_concurrency_of_simultaneous_arrivals_is_the_request_count(tiny_model_dir):
    info = load_model_info(str(tiny_model_dir), dtype="float32")
    trace = synthesize("random", num_requests=12, rate=1.0, vocab_size=info.config.vocab_size, length_scale=0.25)
    for r in trace:
        r.arrival_time = 0.0
    p = profile_trace(trace, info, COSTS, EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 24))
    assert p.memory.peak_concurrency == 12
    assert p.memory.peak_kv_tokens == sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in trace) - 12
    fit = p.memory.kv_tokens_fit["none"]
    assert fit == (1 << 24) // info.kv_bytes_per_token()


# ---- 2. prefix structure -----------------------------------------------------------------------


def test_prefix_hit_rate_is_the_shared_fraction_by_construction():
    rng = random.Random(0)
    shared = rand_tokens(rng, 64)  # 4 blocks of 16
    prompts = [shared + rand_tokens(rng, 16) for _ in range(10)]
    p = prefix_profile(prompts, [None] * 10, block_size=16)
    # The first prompt misses; the other nine hit the 64 shared tokens of their 80.
    assert p.hit_rate == pytest.approx(9 * 64 / (10 * 80))
    assert p.cached_tokens == [0] + [64] * 9 and p.requests_with_hits == pytest.approx(0.9)
    none = prefix_profile([rand_tokens(rng, 80) for _ in range(10)], [None] * 10, block_size=16)
    assert none.hit_rate == 0.0


def test_known_outputs_are_cached_like_the_engine_caches_them():
    rng = random.Random(1)
    first, answer = rand_tokens(rng, 32), rand_tokens(rng, 32)
    second = first + answer + rand_tokens(rng, 16)  # the next turn of the conversation
    p = prefix_profile([first, second], [answer, None], block_size=16)
    assert p.cached_tokens == [0, 64]


def test_a_small_pool_evicts_and_the_curve_shows_it():
    rng = random.Random(2)
    prompts = [rand_tokens(rng, 64) for _ in range(8)] * 2  # each prompt comes back once, 8 prompts later
    p = prefix_profile(prompts, [None] * 16, block_size=16, curve_points=4)
    sizes = [s for s, _ in p.hit_rate_curve]
    rates = [r for _, r in p.hit_rate_curve]
    # With room for all: the 8 returning prompts hit 3 of their 4 blocks (the last token is computed).
    assert sizes == sorted(sizes) and rates[-1] == p.hit_rate == 8 * 48 / (16 * 64)
    assert rates[0] == 0.0  # a pool of a few blocks forgets every prompt before it returns


# ---- 3. heterogeneity --------------------------------------------------------------------------


def test_static_batching_waste_follows_the_formula():
    uniform = heterogeneity_profile([100] * 8, [50] * 8, batch_size=4)
    assert uniform.static_waste == 0.0
    # One batch of two: padded to (100 + 100) x 2 = 400 slots, 220 of them useful.
    mixed = heterogeneity_profile([10, 100], [10, 100], batch_size=2)
    assert mixed.static_waste == pytest.approx(1 - 220 / 400)
    assert mixed.prompt_len.max == 100 and mixed.output_len.p50 == 10


def test_heterogeneous_trace_wastes_more_than_uniform(tiny_model_dir):
    info = load_model_info(str(tiny_model_dir), dtype="float32")
    cfg = EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 24)

    def waste(shape: str) -> float:
        trace = synthesize(shape, 32, rate=50.0, vocab_size=info.config.vocab_size, length_scale=0.3)
        for r in trace:
            r.arrival_time = 0.0  # one static batch of everything
        return profile_trace(trace, info, COSTS, cfg).heterogeneity.static_waste

    assert waste("random") < 0.05 < 0.3 < waste("mixed")


# ---- 4. fragmentation --------------------------------------------------------------------------


def test_paged_cache_holds_less_than_contiguous_reservations(tiny_model_dir):
    info = load_model_info(str(tiny_model_dir), dtype="float32")
    trace = synthesize("random", 6, rate=1.0, vocab_size=info.config.vocab_size, length_scale=0.25)
    for r in trace:
        r.arrival_time, r.max_tokens = 0.0, 3 * len(r.output_token_ids)  # generous max_tokens, as users set
    f = profile_trace(trace, info, COSTS, EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 24)).fragmentation
    p, o = len(trace[0].prompt_token_ids), len(trace[0].output_token_ids)
    assert f.peak_used_tokens == 6 * (p + o) - 6  # the last token of each is sampled, never stored
    assert f.peak_paged_tokens == 6 * (-(-(p + o - 1) // 16) * 16)
    assert f.peak_reserved_tokens == 6 * (p + 3 * o)
    assert f.peak_max_len_tokens == 6 * info.max_model_len
    assert f.peak_used_tokens <= f.peak_paged_tokens < f.peak_reserved_tokens < f.peak_max_len_tokens


# ---- 5. speculation ----------------------------------------------------------------------------


def test_ngram_acceptance_by_hand():
    # No earlier "6": a plain step takes 4. Then "4" was seen before "5 6": the draft [5, 6, 4]
    # has its first two tokens accepted, which ends the output.
    assert ngram_acceptance([1, 2, 3, 4, 5, 6], [4, 5, 6], k=4, use_engine_proposer=False) == (2, 1, 3, 2)


def test_the_engine_proposer_gives_the_same_acceptance():
    pytest.importorskip("tessera.spec.ngram")
    # The engine's proposer extends a match that runs into the end of the text periodically, so
    # its draft is [5, 6, 4, 5]: one more token proposed, the same two accepted.
    assert ngram_acceptance([1, 2, 3, 4, 5, 6], [4, 5, 6], k=4) == (2, 1, 4, 2)


def test_copying_outputs_are_predicted_and_random_ones_are_not():
    rng = random.Random(3)
    prompts = [rand_tokens(rng, 200) for _ in range(4)]
    copies = [p[50:170] for p in prompts]
    randoms = [rand_tokens(rng, 120) for _ in range(4)]
    copy = speculation_profile(prompts, copies, COSTS, [1, 8], k=4)
    rand = speculation_profile(prompts, randoms, COSTS, [1, 8], k=4)
    assert copy.acceptance_rate > 0.9 and copy.tokens_per_step > 4
    assert rand.acceptance_rate < 0.05 and rand.tokens_per_step < 1.05
    assert copy.speedup_by_batch[1] > 2 and rand.speedup_by_batch[1] < 1.0
    assert speculation_profile(prompts, [None] * 4, COSTS, [1]) is None


# ---- 6. scale and the simulation ------------------------------------------------------------------


def test_simulation_timing_by_hand():
    costs = StepCosts(base_s=1.0, per_decode_s=0.0, per_prefill_token_s=0.0)
    one = simulate([SimRequest(0.0, 100, 3)], costs, max_num_batched_tokens=512, max_num_seqs=8)
    (o,) = one.outcomes
    assert (o.ttft, o.itl, o.finish, o.gaps) == (1.0, 1.0, 3.0, [1.0, 1.0])  # prefill step, then two decode steps
    chunked = simulate([SimRequest(0.0, 100, 3)], costs, max_num_batched_tokens=50, max_num_seqs=8)
    assert chunked.outcomes[0].ttft == 2.0  # two chunks of 50
    cached = simulate([SimRequest(0.0, 100, 3, cached_len=64)], costs, max_num_batched_tokens=50, max_num_seqs=8)
    assert cached.outcomes[0].ttft == 1.0  # 36 tokens left: one chunk
    late = simulate([SimRequest(0.0, 10, 2), SimRequest(5.0, 10, 2)], costs, 512, 8)
    assert [x.ttft for x in late.outcomes] == [1.0, 1.0] and late.end == 7.0
    assert late.goodput(slo_ttft_s=1.0, slo_itl_s=1.0) == pytest.approx(2 / 7)
    assert late.goodput(slo_ttft_s=0.5, slo_itl_s=1.0) == 0.0


def test_attention_cost_grows_with_the_context():
    costs = StepCosts(base_s=0.0, per_decode_s=0.0, per_prefill_token_s=0.0, per_attention_s=1.0)
    (o,) = simulate([SimRequest(0.0, 100, 2)], costs, max_num_batched_tokens=50, max_num_seqs=8).outcomes
    # Chunks of 50 at positions 0 and 50: 50 x 25 + 50 x 75 pairs; then a decode over 100 keys.
    assert o.ttft == 50 * 25 + 50 * 75 and o.finish == o.ttft + 100.5


def test_speculation_yields_several_tokens_per_step_and_costs_its_drafts():
    from tessera.advisor.sim import Speculation

    free_drafts = StepCosts(base_s=1.0, per_decode_s=0.0, per_prefill_token_s=0.0)
    (o,) = simulate([SimRequest(0.0, 10, 9)], free_drafts, 512, 8, speculation=Speculation(4.0, 3.0)).outcomes
    # The prefill step gives token 1; each verify step 4 more: 5 at t=2, 9 at t=3.
    assert (o.ttft, o.finish, o.gaps) == (1.0, 3.0, [0.25] * 8)
    costly = StepCosts(base_s=1.0, per_decode_s=0.0, per_prefill_token_s=1.0)
    (o,) = simulate([SimRequest(0.0, 10, 9)], costly, 512, 8, speculation=Speculation(4.0, 3.0)).outcomes
    assert o.finish == 11.0 + 2 * 4.0  # the 10-token prefill, then two steps of 1 + 3 draft tokens


def test_batch_limit_queues_and_prefill_decode_shares_add_up():
    reqs = [SimRequest(0.0, 32, 4) for _ in range(6)]
    limited = simulate(reqs, COSTS, 512, max_num_seqs=2)
    assert limited.peak("running") == 2 and limited.peak("waiting") == 4
    total = limited.prefill_time_s + limited.decode_time_s
    assert total == pytest.approx(limited.end - limited.start)


def test_disaggregation_and_replicas_simulate_every_request():
    rng = random.Random(4)
    reqs = [SimRequest(i * 0.01, rng.randint(100, 800), rng.randint(2, 64)) for i in range(30)]
    split = simulate_disaggregated(reqs, COSTS, 512, 64, transfer_s_per_token=1e-6)
    two = simulate_replicas(reqs, COSTS, 512, 64, 2)
    assert len(split.outcomes) == len(two.outcomes) == 30
    assert all(o.ttft > 0 for o in split.outcomes)
    # Decode workers never run a prefill chunk, so no decode waits behind one.
    assert max(max(o.gaps[1:], default=0) for o in split.outcomes) <= COSTS.step_time(1, 64) + 1e-9


def test_scale_reports_the_arrival_rate(tiny_model_dir):
    info = load_model_info(str(tiny_model_dir), dtype="float32")
    trace = synthesize("random", 11, rate=1.0, vocab_size=info.config.vocab_size, length_scale=0.1)
    for i, r in enumerate(trace):
        r.arrival_time = i * 0.5  # 2 requests per second
    s = profile_trace(trace, info, COSTS, EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 24)).scale
    assert s.arrival_rate == pytest.approx(2.0) and s.duration_s == pytest.approx(5.0)
    assert s.interarrival_cv == pytest.approx(0.0) and s.peak_rate_1s == 3
    assert s.prefill_share + s.decode_share == pytest.approx(1.0)


def test_step_costs_measured_under_other_openmp_settings_are_not_reused(tiny_model_dir, monkeypatch):
    # OMP_WAIT_POLICY=PASSIVE doubled a bf16 decode step of the default model: a probe cached
    # under one policy must not stand for the other.
    info = load_model_info(str(tiny_model_dir), "float32")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    default = profile_module._cache_key(info, 2, "none")
    assert profile_module._cache_key(info, 2, "none") == default
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    passive = profile_module._cache_key(info, 2, "none")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert len({default, passive, profile_module._cache_key(info, 2, "none")}) == 3
