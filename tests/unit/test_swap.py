"""The host KV tier: swap-mode preemption gives the same greedy outputs as recompute and as
transformers, copies exactly the right bytes, keeps both pools consistent after every step, and
really saves the recompute."""

from __future__ import annotations

import argparse

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tessera import SamplingParams
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.engine.kv_cache import KVCacheManager
from tessera.engine.request import Sequence
from tessera.engine.scheduler import Scheduler, SchedulerOutput
from tessera.engine.swap import HostBlockPool, HostKVCache, PreemptionPolicy, SwapCosts, num_host_kv_blocks
from tessera.engine_args import add_engine_arguments, engine_kwargs
from tests.unit.test_engine import hf_greedy, random_prompts
from tests.unit.test_scheduler import Sim, expected_output, make_seq, prompts

BS = 4
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
NUM_OUTPUT = 24


def gib_for_blocks(n: int) -> float:
    return n * BS * TINY_KV_BYTES_PER_TOKEN / (1 << 30)


def make_engine(path, **kw) -> LLMEngine:
    # 60 usable blocks of 4 tokens for 16 sequences that grow to 27..84 tokens: many preemptions.
    cfg = dict(dtype="float32", block_size=BS, kv_cache_memory=61 * BS * TINY_KV_BYTES_PER_TOKEN,
               max_num_batched_tokens=32, max_num_seqs=16)
    return LLMEngine(EngineConfig(model=str(path), **(cfg | kw)))


def run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict[str, list[int]], int]:
    """Generate greedily for every prompt at once, checking both pools after every step.
    Returns the outputs and the number of tokens the model computed."""
    params = SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    results, computed = {}, 0
    for _ in range(20_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        computed += engine.stats().last_step_num_tokens
        engine.check_invariants()
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.kv_cache_usage == 0 and stats.num_swapped_seqs == 0
    assert stats.num_host_free_blocks == stats.num_host_total_blocks
    return results, computed


@pytest.fixture(scope="module")
def workload(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(16, hf.config.vocab_size, seed=0)
    expected = {str(i): hf_greedy(hf, p, NUM_OUTPUT) for i, p in enumerate(prompts)}
    return prompts, expected


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swap_preemption_equals_recompute_and_transformers(tiny_model_dir, workload, prefix_caching):
    prompts, expected = workload
    recompute = make_engine(tiny_model_dir, enable_prefix_caching=prefix_caching, preemption_mode="recompute")
    swap = make_engine(tiny_model_dir, enable_prefix_caching=prefix_caching, preemption_mode="swap",
                       swap_space=gib_for_blocks(200))
    out_recompute, computed_recompute = run(recompute, prompts)
    out_swap, computed_swap = run(swap, prompts)
    assert out_recompute == expected and out_swap == expected
    r, s = recompute.stats(), swap.stats()
    assert r.num_preemptions > 0 and s.num_preemptions > 0, "the workload is meant to force preemption"
    assert r.num_swapped_out_blocks == 0
    assert s.num_swapped_out_blocks > 0 and s.num_swapped_in_blocks > 0
    # The host pool never ran short, so every preemption was a swap and no token was computed
    # twice: each sequence computed its prompt and all of its outputs but the last, once.
    assert computed_swap == sum(len(p) + NUM_OUTPUT - 1 for p in prompts)
    assert computed_swap < computed_recompute
    if prefix_caching:
        # Blocks still cached on the device come back from the prefix cache, not the host.
        assert s.num_swapped_in_blocks <= s.num_swapped_out_blocks
    else:
        assert s.num_swapped_in_blocks == s.num_swapped_out_blocks


def test_a_host_pool_too_small_for_some_victims_falls_back_to_recompute(tiny_model_dir, workload):
    prompts, expected = workload
    engine = make_engine(tiny_model_dir, preemption_mode="swap", swap_space=gib_for_blocks(12))
    out, _ = run(engine, prompts)
    assert out == expected
    assert engine.stats().num_host_total_blocks == 12 and engine.stats().num_swapped_out_blocks > 0


def test_auto_mode_measures_costs_and_stays_exact(tiny_model_dir, workload):
    prompts, expected = workload
    engine = make_engine(tiny_model_dir, preemption_mode="auto", swap_space=gib_for_blocks(200))
    costs = engine.scheduler.preemption.costs
    assert costs.prefill_per_token_s > 0 and costs.roundtrip_per_block_s >= 0
    assert run(engine, prompts)[0] == expected


def test_aborting_a_swapped_out_request_frees_its_host_blocks(tiny_model_dir, workload):
    prompts, expected = workload
    engine = make_engine(tiny_model_dir, preemption_mode="swap", swap_space=gib_for_blocks(200))
    params = SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    for _ in range(1000):
        engine.step()
        engine.check_invariants()
        if engine.host_pool.num_swapped_seqs:
            break
    swapped = [s for s in engine.scheduler.waiting if engine.host_pool.holds(s)]
    assert swapped, "no sequence was swapped out"
    victim = swapped[0]
    num_victim_blocks = -(-engine.host_pool.num_saved_tokens(victim) // BS)
    free_before = engine.host_pool.num_free_blocks
    engine.abort_request(victim.request_id)
    engine.check_invariants()
    assert not engine.host_pool.holds(victim)
    assert engine.host_pool.num_free_blocks == free_before + num_victim_blocks
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
    assert results == {k: v for k, v in expected.items() if k != victim.request_id}


def test_host_cache_round_trip_copies_exactly_the_named_blocks():
    torch.manual_seed(0)
    device = [(torch.randn(8 * BS, 2, 3), torch.randn(8 * BS, 2, 3)) for _ in range(3)]
    original = [tuple(t.clone() for t in layer) for layer in device]
    host = HostKVCache(device, num_blocks=4, block_size=BS)
    host.swap_out(device, [(3, 0), (1, 2)])
    for host_layer, orig in zip(host.caches, original, strict=True):
        for h, d in zip(host_layer, orig, strict=True):
            assert torch.equal(h[0:BS], d[3 * BS : 4 * BS]) and torch.equal(h[2 * BS : 3 * BS], d[BS : 2 * BS])
            assert not h[BS : 2 * BS].any() and not h[3 * BS :].any()  # untouched host blocks
    host.swap_in(device, [(0, 5), (2, 6)])
    for layer, orig in zip(device, original, strict=True):
        for d, o in zip(layer, orig, strict=True):
            assert torch.equal(d[5 * BS : 6 * BS], o[3 * BS : 4 * BS]) and torch.equal(d[6 * BS : 7 * BS], o[BS : 2 * BS])
            untouched = [b for b in range(8) if b not in (5, 6)]
            for b in untouched:
                assert torch.equal(d[b * BS : (b + 1) * BS], o[b * BS : (b + 1) * BS])


def test_policy_decisions():
    host = HostBlockPool(num_blocks=4, block_size=BS)
    seq = make_seq(list(range(20)))
    seq.num_computed_tokens = 12  # 3 blocks
    assert not PreemptionPolicy("recompute").should_swap(seq, host, 0)
    assert PreemptionPolicy("swap").should_swap(seq, host, 0)
    assert not PreemptionPolicy("swap").should_swap(seq, None, 0)
    seq.num_computed_tokens = 17  # 5 blocks: more than the host pool has
    assert not PreemptionPolicy("swap").should_swap(seq, host, 0)
    seq.num_computed_tokens = 12
    costs = SwapCosts(roundtrip_overhead_s=100e-6, roundtrip_per_block_s=10e-6, prefill_per_token_s=20e-6)
    auto = PreemptionPolicy("auto", costs)
    assert auto.should_swap(seq, host, 0)  # 130 us of copies vs 240 us of prefill
    assert not auto.should_swap(seq, host, 8)  # only 4 tokens to recompute: 80 us
    with pytest.raises(ValueError, match="--preemption-mode"):
        PreemptionPolicy("sometimes")


def test_flags_and_config_errors_name_the_flag(tiny_model_dir):
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    kw = engine_kwargs(p.parse_args(["--swap-space", "2", "--preemption-mode", "swap"]))
    assert (kw["swap_space"], kw["preemption_mode"]) == (2.0, "swap")
    assert EngineConfig().preemption_mode == "auto" and EngineConfig().swap_space == 0
    with pytest.raises(ValueError, match="--swap-space"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="--swap-space"):
        EngineConfig(swap_space=-1)
    with pytest.raises(ValueError, match="--preemption-mode"):
        EngineConfig(preemption_mode="never")
    with pytest.raises(ValueError, match="--swap-space"):
        num_host_kv_blocks(1e-9, BS, TINY_KV_BYTES_PER_TOKEN)
    assert num_host_kv_blocks(gib_for_blocks(7), BS, TINY_KV_BYTES_PER_TOKEN) == 7
    engine = make_engine(tiny_model_dir)  # no --swap-space: auto means recompute, no host pool
    assert engine.host_pool is None and engine.runner.host_kv is None
    assert engine.scheduler.preemption.mode == "recompute"


# ---- the scheduler with a model of what every device and host slot holds ---------------------


class SwapSim(Sim):
    """test_scheduler's Sim (which checks that every chunk reads the right K/V from its block
    table) with a host pool: the step's swap copies move slot contents between the pools."""

    def __init__(self, num_host_blocks: int, mode: str, **kw) -> None:
        super().__init__(**kw)
        self.host = HostBlockPool(num_host_blocks, kw["block_size"])
        self.sched = Scheduler(self.kv, self.sched.max_num_seqs, self.sched.max_num_batched_tokens,
                               self.sched.max_model_len, host=self.host, preemption=PreemptionPolicy(mode))
        self.host_slots: dict[tuple[int, int], tuple[int, ...]] = {}
        schedule = self.sched.schedule

        def schedule_and_copy() -> SchedulerOutput:
            out = schedule()
            bs = self.kv.block_size
            if out.preempted:
                assert not out.swap_in, "a step that preempts admits nobody"
            host_targets = [host_block for _, host_block in out.swap_out]
            assert len(set(host_targets)) == len(host_targets), "one host block is copied into twice"
            for device_block, host_block in out.swap_out:
                for o in range(bs):
                    self.host_slots[(host_block, o)] = self.slots.get((device_block, o))
            for host_block, device_block in out.swap_in:
                for o in range(bs):
                    self.slots[(device_block, o)] = self.host_slots[(host_block, o)]
            return out

        self.sched.schedule = schedule_and_copy

    def step(self) -> SchedulerOutput:
        out = super().step()
        self.host.check_invariants(self.live)
        return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(6, 14),  # small pools, so most examples preempt
    num_host_blocks=st.integers(1, 30),
    max_num_seqs=st.integers(2, 5),
    extra_budget=st.integers(0, 16),
    requests=st.lists(st.tuples(prompts, st.integers(4, 16), st.integers(0, 2)), min_size=3, max_size=8),
    prefix_caching=st.booleans(),
    finish_prob=st.sampled_from([0.0, 0.2]),
    seed=st.integers(0, 2**16),
)
# Found by the search: seq 5's new block evicts cached block 7 (demoted to host block 4, the
# least recent), then seq 3's swap-out drops that demotion and retakes host block 4; the demotion
# copy ran after the swap-out and overwrote seq 3's K/V.
@example(block_size=2, num_blocks=12, num_host_blocks=8, max_num_seqs=2, extra_budget=0,
         requests=[([0], 4, 0), ([0], 4, 0), ([0], 5, 0), ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0], 5, 1),
                   ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0, 0, 0, 0, 0], 4, 0), ([0], 9, 0)],
         prefix_caching=True, finish_prob=0.0, seed=0)
def test_random_workloads_with_swapping_read_the_right_kv_and_drain(
    block_size, num_blocks, num_host_blocks, max_num_seqs, extra_budget, requests, prefix_caching, finish_prob, seed,
):
    sim = SwapSim(num_host_blocks, "swap", num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_seqs + extra_budget, max_model_len=40,
                  enable_prefix_caching=prefix_caching, finish_prob=finish_prob, seed=seed)
    arrivals: dict[int, list[Sequence]] = {}
    cap = min(40, (num_blocks - 1) * block_size)  # every request fits the pool alone; together they collide
    for prompt, max_tokens, arrive_at in requests:
        prompt = prompt[: cap - 1]
        arrivals.setdefault(arrive_at, []).append(make_seq(prompt, min(max_tokens, cap - len(prompt))))
    for step in range(10_000):
        for seq in arrivals.pop(step, []):
            sim.add(seq)
        if not arrivals and not sim.sched.has_unfinished():
            break
        sim.step()
    sim.assert_drained()
    assert sim.host.num_free_blocks == num_host_blocks and sim.host.num_swapped_seqs == 0
    for seq in sim.finished:
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.num_output_tokens)


def test_a_swapped_sequence_resumes_without_recomputing_and_its_blocks_are_cached_again():
    # 5 usable blocks of 4 tokens; three requests that grow to 16 tokens each collide.
    sim = SwapSim(num_host_blocks=16, mode="swap", num_blocks=6, block_size=4, max_num_seqs=3,
                  max_num_batched_tokens=16, enable_prefix_caching=True)
    seqs = [make_seq([10 + i] * 4, max_tokens=12) for i in range(3)]
    for seq in seqs:
        sim.add(seq)
    sim.run()
    sim.assert_drained()
    swaps = [out for out in sim.outputs if out.swap_out]
    assert swaps and sim.host.num_swapped_out_blocks > 0
    assert any(out.swap_in for out in sim.outputs)
    computed = sum(out.num_batched_tokens for out in sim.outputs)
    assert computed == sum(s.num_prompt_tokens + s.num_output_tokens - 1 for s in seqs)  # nothing twice
    kv: KVCacheManager = sim.kv
    assert kv.num_cached_blocks > 0
