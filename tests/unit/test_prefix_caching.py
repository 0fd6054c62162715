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
