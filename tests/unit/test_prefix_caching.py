"""Automatic prefix caching through the real engine: caching on and off give the same greedy
outputs as transformers on workloads built to hit the cache (shared prefixes, conversations,
prompts that differ in their last token) and to evict from it; the KV invariant holds after
every step; and a property test of KVCacheManager against a model of what each block holds."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tessera import SamplingParams
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.engine.kv_cache import KVCacheManager, hash_block
from tessera.engine.request import Sequence
from tessera.engine.swap import HostBlockPool
from tests.unit.test_engine import hf_greedy

TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def make_engine(path, caching: bool, **kw) -> LLMEngine:
    # A pool of 1024 tokens: room for every workload below, and small enough that checking the
    # invariant after every step stays cheap.
    kw.setdefault("kv_cache_memory", 1024 * TINY_KV_BYTES_PER_TOKEN)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", enable_prefix_caching=caching, **kw))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_arrivals(engine: LLMEngine, arrivals: list[tuple[int, list[int], int]]) -> dict[int, tuple[list[int], int]]:
    """Add request i (arrival step, prompt, max_tokens) at its step; step to the end, checking
    the KV invariant after every step. Returns i -> (output token ids, prompt tokens it got
    from the prefix cache)."""
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    results: dict[int, tuple[list[int], int]] = {}
    for step in range(10_000):
        while pending and arrivals[pending[0]][0] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), arrivals[i][1], greedy(arrivals[i][2]))
        if not pending and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = (out.outputs[0].token_ids, out.metrics.num_cached_tokens)
        engine.check_invariants()
    assert engine.stats().kv_cache_usage == 0
    return results


def assert_on_equals_off_equals_hf(tiny_model_dir, hf_model, arrivals, **engine_kw) -> tuple[dict, LLMEngine]:
    on_engine = make_engine(tiny_model_dir, True, **engine_kw)
    on = run_arrivals(on_engine, arrivals)
    off_engine = make_engine(tiny_model_dir, False, **engine_kw)
    off = run_arrivals(off_engine, arrivals)
    assert off_engine.stats().prefix_cache_hits == 0 and all(cached == 0 for _, cached in off.values())
    for i, (_, prompt, max_tokens) in enumerate(arrivals):
        expected = hf_greedy(hf_model, prompt, max_tokens)
        assert on[i][0] == expected, f"request {i}, caching on"
        assert off[i][0] == expected, f"request {i}, caching off"
    return on, on_engine


def test_shared_prefix_staggered_hits_the_blocks_earlier_requests_computed(tiny_model_dir, hf_model):
    rng = random.Random(1)
    vocab = hf_model.config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(48)]  # 12 blocks of 4
    arrivals = [(3 * i, prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 8))], 8) for i in range(10)]
    on, engine = assert_on_equals_off_equals_hf(tiny_model_dir, hf_model, arrivals, block_size=4,
                                                max_num_batched_tokens=64)
    assert on[0][1] == 0
    assert all(on[i][1] >= 48 for i in range(1, 10)), [on[i][1] for i in range(10)]
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 9 * 48
    assert stats.prefix_cache_hit_rate == pytest.approx(stats.prefix_cache_hits / stats.prefix_cache_queries)
    assert stats.prefix_cache_hit_rate > 0.75


def test_multi_turn_conversation_hits_prompt_and_generated_tokens(tiny_model_dir, hf_model):
    rng = random.Random(2)
    vocab = hf_model.config.vocab_size
    engines = {caching: make_engine(tiny_model_dir, caching) for caching in (True, False)}  # block size 16
    prompt = [rng.randrange(vocab) for _ in range(21)]
    prev_computed = 0  # tokens whose K/V the previous turn computed
    for turn in range(1, 6):
        expected = hf_greedy(hf_model, prompt, 12)
        outputs = {}
        for caching, engine in engines.items():
            before = engine.stats()
            out = run_arrivals(engine, [(0, prompt, 12)])[0][0]
            after = engine.stats()
            outputs[caching] = out
            queries = after.prefix_cache_queries - before.prefix_cache_queries
            hits = after.prefix_cache_hits - before.prefix_cache_hits
            if not caching:
                assert hits == 0
            elif turn == 1:
                assert (queries, hits) == (len(prompt), 0)
            else:
                # The previous turn computed its prompt and all its outputs but the last: every
                # full block of those, generated tokens included, is a hit now.
                assert queries == len(prompt)
                assert hits == (prev_computed // 16) * 16 and hits / queries > 0.6, (turn, hits, queries)
        assert outputs[True] == outputs[False] == expected, f"turn {turn}"
        prev_computed = len(prompt) + len(expected) - 1
        prompt = prompt + expected + [rng.randrange(vocab) for _ in range(rng.randint(3, 9))]


def test_prompts_that_differ_only_in_their_last_token(tiny_model_dir, hf_model):
    rng = random.Random(3)
    vocab = hf_model.config.vocab_size
    base = [rng.randrange(vocab) for _ in range(37)]
    variants = [base[:-1] + [t] for t in rng.sample(range(vocab), 5)] + [base, base[:36], base + [7]]
    # All at once (they compute the shared blocks side by side), then one by one (they hit them).
    arrivals = [(0, p, 6) for p in variants] + [(200 + 20 * i, p, 6) for i, p in enumerate(variants)]
    on, _ = assert_on_equals_off_equals_hf(tiny_model_dir, hf_model, arrivals, block_size=4)
    for i, p in enumerate(variants):
        cached = on[len(variants) + i][1]
        assert cached == ((len(p) - 1) // 4) * 4, (i, len(p), cached)  # every full block but a final one


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_tiny_pool_forces_eviction_and_preemption_and_outputs_stay_exact(tiny_model_dir, hf_model, preemption):
    rng = random.Random(4)
    vocab = hf_model.config.vocab_size
    stems = [[rng.randrange(vocab) for _ in range(24)] for _ in range(3)]
    prompts = [rng.choice(stems)[: rng.randint(8, 24)] + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
               for _ in range(12)]
    prompts += [prompts[i] for i in (0, 3, 5)]  # repeats: revived if still cached, recomputed if evicted
    arrivals = [(i // 2, p, 16) for i, p in enumerate(prompts)]
    kw = dict(block_size=4, kv_cache_memory=25 * 4 * TINY_KV_BYTES_PER_TOKEN, max_num_batched_tokens=24,
              max_num_seqs=6, preemption_mode=preemption)
    if preemption == "swap":
        kw["swap_space"] = 64 * 4 * TINY_KV_BYTES_PER_TOKEN / (1 << 30)
    _, engine = assert_on_equals_off_equals_hf(tiny_model_dir, hf_model, arrivals, **kw)
    stats = engine.stats()
    assert stats.num_evicted_blocks > 0 and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    if preemption == "swap":
        assert stats.num_swapped_out_blocks > 0


def test_evicted_blocks_are_demoted_to_the_host_tier_and_promoted_back_exactly(tiny_model_dir, hf_model):
    rng = random.Random(5)
    vocab = hf_model.config.vocab_size
    stem = [rng.randrange(vocab) for _ in range(32)]  # 8 blocks of 4
    wave_a = [stem + [rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for _ in range(2)]
    wave_b = [[rng.randrange(vocab) for _ in range(rng.randint(36, 44))] for _ in range(4)]  # unrelated
    wave_c = [stem + [rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for _ in range(3)]
    # Wave B does not fit next to wave A's freed blocks in 25 device blocks: they are evicted, and
    # demoted to the host tier; wave C then hits the stem there.
    arrivals = ([(0, p, 8) for p in wave_a] + [(40 + 2 * i, p, 8) for i, p in enumerate(wave_b)]
                + [(120 + 2 * i, p, 8) for i, p in enumerate(wave_c)])
    kw = dict(block_size=4, kv_cache_memory=26 * 4 * TINY_KV_BYTES_PER_TOKEN, max_num_batched_tokens=24,
              max_num_seqs=4, preemption_mode="recompute", swap_space=64 * 4 * TINY_KV_BYTES_PER_TOKEN / (1 << 30))
    on, engine = assert_on_equals_off_equals_hf(tiny_model_dir, hf_model, arrivals, **kw)
    stats = engine.stats()
    assert stats.num_evicted_blocks > 0 and stats.num_demoted_blocks > 0, "the workload is meant to demote"
    assert stats.num_promoted_blocks >= 8, stats
    assert stats.num_demoted_blocks == stats.num_promoted_blocks + stats.num_host_cached_blocks + \
        engine.host_pool.num_evicted_blocks
    first_c = len(wave_a) + len(wave_b)
    assert all(on[first_c + i][1] >= 32 for i in range(len(wave_c))), [on[i][1] for i in range(len(arrivals))]
    # Without the host tier the stem was forgotten: the first request of wave C recomputes it.
    no_host = make_engine(tiny_model_dir, True, **(kw | dict(swap_space=0)))
    plain = run_arrivals(no_host, arrivals)
    assert plain[first_c][1] < 32 and plain[first_c][0] == on[first_c][0]


# ---- the block manager against a model of block contents ----------------------------------------

BS = 2
STEMS = [[(5 * i + j) % 7 for j in range(16)] for i in range(3)]


def next_token(tokens: list[int]) -> int:
    """A deterministic stand-in for the model: equal histories continue equally, so generated
    tokens of one sequence can be prefix hits for another."""
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 7


class BlockManagerMachine(RuleBasedStateMachine):
    """Any sequence of admit / compute / append / free (with eviction forced by a small pool)
    keeps ref counts and the hash table consistent, never hands out a block in use, and every
    block a sequence reads (hit, revived or its own) holds exactly the K/V of its tokens.

    `contents[(block, offset)]` is the token prefix whose K/V the slot holds, what real K/V
    depend on; computing a token writes it; a block in the hash table must hold exactly the
    prefix its hash names."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=9, block_size=BS)  # small: frees are soon evicted
        self.live: list[Sequence] = []
        self.contents: dict[tuple[int, int], tuple[int, ...]] = {}

    def _held_by_others(self, seq: Sequence) -> set[int]:
        return {b for s in self.live if s is not seq for b in s.block_table}

    def _check_reads(self, seq: Sequence) -> None:
        tokens = seq.token_ids
        for p in range(seq.num_computed_tokens):
            assert self.contents.get((seq.block_table[p // BS], p % BS)) == tuple(tokens[: p + 1]), (
                f"seq {seq.seq_id} would read wrong K/V at position {p}")

    def _compute(self, seq: Sequence, n: int) -> None:
        before = set(seq.block_table)
        others = self._held_by_others(seq)
        assert self.kv.allocate_slots(seq, n), "the caller checked there is room"
        assert not (set(seq.block_table) - before) & others, "handed out a block in use"
        self._write(seq, n)

    def _write(self, seq: Sequence, n: int) -> None:
        self._check_reads(seq)
        tokens = seq.token_ids
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[p // BS]
            assert self.kv.blocks[block].ref_count == 1, f"write into shared block {block}"
            self.contents[(block, p % BS)] = tuple(tokens[: p + 1])
        seq.num_computed_tokens += n
        self.kv.commit_computed(seq)

    @rule(stem=st.integers(0, 2), k=st.integers(1, 16), tail=st.lists(st.integers(0, 6), max_size=3),
          budget=st.integers(1, 20))
    def admit(self, stem, k, tail, budget):
        seq = Sequence(f"r{len(self.live)}", STEMS[stem][:k] + tail, SamplingParams(max_tokens=8, ignore_eos=True))
        others = self._held_by_others(seq)
        free_before = self.kv.num_free_blocks
        if not self.kv.allocate_for_admission(seq, budget):
            assert seq.block_table == [] and seq.num_computed_tokens == 0 and self.kv.num_free_blocks == free_before
            return
        num_hit = seq.num_computed_tokens // BS
        assert seq.num_computed_tokens < seq.num_tokens
        assert not set(seq.block_table[num_hit:]) & others, "handed out a block in use"
        self.live.append(seq)
        self._write(seq, min(seq.num_uncomputed_tokens, budget))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data):
        """Compute a chunk of a sequence's uncomputed tokens, or, if none are left, sample and
        append its next token (computed by a later step)."""
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_uncomputed_tokens == 0:
            seq.output_token_ids.append(next_token(seq.token_ids))
            return
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        needed = self.kv.num_blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
        if needed > self.kv.num_free_blocks:
            table = list(seq.block_table)
            assert not self.kv.allocate_slots(seq, n) and seq.block_table == table
            return
        self._compute(seq, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.kv.free(seq)
        self.live.remove(seq)
        assert seq.block_table == []

    @invariant()
    def consistent(self):
        self.kv.check_invariants(self.live)
        for seq in self.live:
            self._check_reads(seq)
        for block in self.kv.blocks[1:]:
            if block.block_hash is None:
                continue
            prefix = self.contents.get((block.block_id, BS - 1))
            assert prefix is not None and len(prefix) % BS == 0, f"block {block.block_id} cached but not full"
            chain = None
            for i in range(len(prefix) // BS):
                chain = hash_block(chain, list(prefix[i * BS : (i + 1) * BS]))
            assert chain == block.block_hash, f"block {block.block_id} holds another prefix than its hash names"
            for o in range(BS):  # the whole block holds that prefix, not only its last slot
                assert self.contents[(block.block_id, o)] == prefix[: len(prefix) - BS + o + 1]
        assert self.kv.prefix_hits <= self.kv.prefix_queries


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase


class TwoTierMachine(BlockManagerMachine):
    """The same, with a small host tier attached: evicted cached blocks are demoted (their slot
    contents copied to a host block), host-resident hits promoted (copied back into a fresh
    device block), the copies run as the engine runs them (all demotions, then all promotions,
    before the step writes anything). On top of the device checks: the host pool is consistent,
    every host-cached hash names exactly the prefix its host block holds, and every promoted
    block a sequence reads holds the right K/V (checked by the base class's reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.host = HostBlockPool(num_blocks=5, block_size=BS)
        self.kv.attach_host_tier(self.host)
        self.host_contents: dict[tuple[int, int], tuple[int, ...] | None] = {}

    def _write(self, seq: Sequence, n: int) -> None:
        demotions, promotions = self.kv.take_block_copies()
        in_use = {b for s in self.live for b in s.block_table if s is not seq}
        for device_block, host_block in demotions:
            # Evicted for seq's new content: nobody else may read it any more.
            assert device_block in seq.block_table and device_block not in in_use, "demoted a block in use"
            for o in range(BS):
                self.host_contents[(host_block, o)] = self.contents.get((device_block, o))
        for host_block, device_block in promotions:
            assert device_block in seq.block_table and device_block not in in_use
            for o in range(BS):
                self.contents[(device_block, o)] = self.host_contents[(host_block, o)]
        self.host.begin_step()  # the step's copies ran
        super()._write(seq, n)

    @invariant()
    def host_consistent(self):
        self.host.check_invariants(self.live)  # nobody is swapped out here: held == 0
        assert self.kv.take_block_copies() == ([], []), "copies owed outside a step"
        for block_hash, host_block in self.host.cached_blocks().items():
            prefix = self.host_contents.get((host_block, BS - 1))
            assert prefix is not None and len(prefix) % BS == 0, f"host block {host_block} cached but not full"
            chain = None
            for i in range(len(prefix) // BS):
                chain = hash_block(chain, list(prefix[i * BS : (i + 1) * BS]))
            assert chain == block_hash, f"host block {host_block} holds another prefix than its hash names"
            for o in range(BS):
                assert self.host_contents[(host_block, o)] == prefix[: len(prefix) - BS + o + 1]
        h = self.host
        assert h.num_demoted_blocks == h.num_promoted_blocks + h.num_cached_blocks + h.num_evicted_blocks


TwoTierMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
test_two_tier_block_manager_state_machine = TwoTierMachine.TestCase


def test_the_two_tier_machine_really_demotes_and_promotes():
    """The state machine above is only worth its name if its workloads reach both copies."""
    m = TwoTierMachine()

    def admit(tokens: list[int]) -> Sequence:
        seq = Sequence("r", tokens, SamplingParams(max_tokens=8, ignore_eos=True))
        assert m.kv.allocate_for_admission(seq, 100)
        m.live.append(seq)
        m._write(seq, seq.num_uncomputed_tokens)
        return seq

    def free(seq: Sequence) -> None:
        m.kv.free(seq)
        m.live.remove(seq)

    free(admit(STEMS[0]))  # 8 blocks computed, cached and freed
    free(admit(STEMS[1][:13] + [1]))  # takes 7 of 8 blocks: stem 0's cached blocks are demoted
    assert m.host.num_demoted_blocks > 0
    again = admit(STEMS[0][:12] + [2])
    assert m.host.num_promoted_blocks == 5 and again.num_cached_tokens == 12  # 1 block on the device, 5 on the host
    m.consistent()
    m.host_consistent()
