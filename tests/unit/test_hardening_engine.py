"""The engine's state machine, fuzzed: random interleavings of add, abort and step on a real
LLMEngine (the tiny model) whose KV pool is so small that sequences are preempted and cached
prefix blocks are evicted all the time. After every rule the KV invariant holds
(`engine.check_invariants()`: ref counts, free list, prefix-cache map) and the scheduler holds
exactly the live requests' unfinished sequences; after every run, with everything aborted or
finished, every block is free.

Examples: TESSERA_FUZZ_EXAMPLES (default 40 runs of up to 40 rules each).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.engine.request import SequenceStatus
from tessera.model.weights import load_model_files
from tessera.sampling import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # usable: about three requests' worth, so the pool runs out constantly
MAX_MODEL_LEN = 64
EXAMPLES = int(os.environ.get("TESSERA_FUZZ_EXAMPLES", "40"))

# Three shared prefixes (one and a half blocks and more), so admissions hit the prefix cache.
PREFIXES = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26, 27, 28, 29], [31, 32]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    bytes_per_block = BLOCK_SIZE * load_model_files(tiny_model_dir).config.kv_bytes_per_token(4)
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                          kv_cache_memory=NUM_BLOCKS * bytes_per_block, max_num_seqs=6, max_num_batched_tokens=16,
                          num_threads=1)
    eng = LLMEngine(config)
    assert eng.kv.num_usable_blocks == NUM_BLOCKS
    return eng


prompts = st.builds(lambda prefix, suffix: prefix + suffix, st.sampled_from(PREFIXES),
                    st.lists(st.integers(1, 200), max_size=14))


def test_engine_state_machine_keeps_the_kv_invariant(engine):
    start = engine.stats()

    class EngineMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.engine = engine
            self.live: dict[str, int] = {}  # request id -> n
            self.counter = 0

        @rule(prompt=prompts, max_tokens=st.integers(1, 24), n=st.integers(1, 3), greedy=st.booleans(),
              seed=st.none() | st.integers(0, 2**63 - 1))
        def add(self, prompt, max_tokens, n, greedy, seed):
            rid = f"r{self.counter}"
            self.counter += 1
            params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0 if greedy else 1.0, seed=seed,
                                    ignore_eos=True)
            try:
                self.engine.add_request(rid, prompt, params)
            except ValueError:  # can never fit the pool: refused, and nothing may be left behind
                assert rid not in self.engine._requests
                return
            self.live[rid] = n

        # The draw does not depend on which requests are live (they depend on the shared engine's
        # prefix cache, which earlier examples filled): hypothesis replays see the same choices.
        @rule(pick=st.integers(0, 63))
        def abort(self, pick):
            if not self.live:
                return
            rid = sorted(self.live)[pick % len(self.live)]
            self.engine.abort_request(rid)
            del self.live[rid]

        @rule()
        def abort_unknown(self):
            self.engine.abort_request(["nobody", "r-1"])

        @rule(steps=st.integers(1, 6))
        def step(self, steps):
            for _ in range(steps):
                for out in self.engine.step():
                    assert out.request_id in self.live, f"output for {out.request_id}, which is not live"
                    assert len(out.outputs) == self.live[out.request_id]
                    if out.finished:
                        assert all(c.finish_reason == "length" for c in out.outputs)
                        del self.live[out.request_id]

        @invariant()
        def kv_invariant_holds(self):
            self.engine.check_invariants()

        @invariant()
        def scheduler_holds_exactly_the_live_sequences(self):
            sched = self.engine.scheduler
            held = [*sched.running, *sched.waiting]
            assert len({s.seq_id for s in held}) == len(held), "a sequence is queued twice"
            assert all(s.request_id in self.live for s in held), "the scheduler holds a dead request's sequence"
            assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
            assert all(s.status is SequenceStatus.WAITING for s in sched.waiting)
            assert set(self.engine._requests) == set(self.live)

        def teardown(self):
            # Half the runs drain by finishing, half by aborting: both must free every block.
            if self.counter % 2:
                for _ in range(2000):
                    if not self.engine.has_unfinished_requests():
                        break
                    self.engine.step()
                    self.engine.check_invariants()
            self.engine.abort_request(list(self.live))
            assert not self.engine.has_unfinished_requests()
            assert not self.engine.scheduler.has_unfinished()
            kv = self.engine.kv
            assert kv.num_free_blocks == kv.num_usable_blocks, "blocks still held after everything ended"
            self.engine.check_invariants()

    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=40, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    end = engine.stats()
    # The fuzz reached the states it is about: preemptions and evictions of cached blocks happened.
    assert end.num_preemptions > start.num_preemptions
    assert engine.kv.num_evictions > 0
