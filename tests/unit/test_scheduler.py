"""Scheduler + KV cache under a simulated engine loop.

The simulation keeps a reference model of the KV pool's contents: the "K/V" written at position p
of a sequence is the tuple of its tokens 0..p (what real K/V depends on). Before a chunk is
computed, every context position it attends to must hold exactly that, whether it was computed
by this sequence, revived from the prefix cache or shared with another sequence; and no chunk
may write into a block another sequence holds. The KV invariant is checked after every step.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tessera.engine.kv_cache import KVCacheManager
from tessera.engine.request import Sequence, SequenceStatus
from tessera.engine.scheduler import Scheduler, SchedulerOutput
from tessera.sampling import SamplingParams

_ids = itertools.count()
# Prompts are drawn from a few shared stems so that prefix hits are common.
STEMS = [[(7 * i + j) % 11 for j in range(40)] for i in range(3)]


def make_seq(prompt: list[int], max_tokens: int = 8, request_id: str | None = None) -> Sequence:
    return Sequence(request_id or f"req-{next(_ids)}", list(prompt),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def next_token(seq: Sequence) -> int:
    """A deterministic 'model': identical histories continue identically, so turns share blocks."""
    tokens = seq.token_ids
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 11


class Sim:
    """The engine loop, with a model of what each KV slot holds."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int = 1024, enable_prefix_caching: bool = True, finish_prob: float = 0.0,
                 seed: int = 0, prefill_only_budget: int | None = None) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               max_model_len=max_model_len)
        self.sched.prefill_only_budget = prefill_only_budget
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.live: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.finish_prob = finish_prob
        self.rng = random.Random(seed)
        self.outputs: list[SchedulerOutput] = []

    def add(self, seq: Sequence) -> None:
        self.sched.add(seq)
        self.live.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        seqs = self.sched.abort(request_id)
        self._retire(seqs)
        return seqs

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED) -> None:
        self.sched.finish(seq, status)
        self._retire([seq])

    def _retire(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            assert seq.block_table == [], "finished sequences hold no blocks"
            self.live.remove(seq)
            self.finished.append(seq)

    def step(self) -> SchedulerOutput:
        decoding = [s for s in self.sched.running if s.num_uncomputed_tokens == 1]
        out = self.sched.schedule()
        self.outputs.append(out)
        self._check_batch(out, budget=self.sched.max_num_batched_tokens if decoding
                          else max(self.sched.max_num_batched_tokens, self.sched.prefill_only_budget or 0))
        served = {id(s.seq) for s in out.scheduled} | {id(s) for s in out.preempted}
        assert all(id(s) in served for s in decoding), "a running decode was stalled"
        for item in out.scheduled:
            self._compute(item.seq, item.num_new_tokens)
        self.sched.update_after_step(out)
        for item in out.scheduled:
            if item.samples:
                self._sample(item.seq)
        self.kv.check_invariants(self.live)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("the workload did not drain: the scheduler hangs")

    def _check_batch(self, out: SchedulerOutput, budget: int) -> None:
        sched = self.sched
        assert out.num_batched_tokens <= budget
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        assert sched.num_running <= sched.max_num_seqs
        assert all(s.num_new_tokens >= 1 for s in out.scheduled)
        flags = [s.is_decode for s in out.scheduled]
        assert flags == sorted(flags, reverse=True), "decodes come first"
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq is sched.waiting[out.preempted[::-1].index(seq)]  # at the front, newest victim last
        for item in out.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING
            assert seq.num_computed_tokens + item.num_new_tokens <= len(seq.block_table) * self.kv.block_size
            assert item.samples == (seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens)

    def _compute(self, seq: Sequence, num_new: int) -> None:
        bs, tokens = self.kv.block_size, seq.token_ids
        start = seq.num_computed_tokens
        for p in range(start):  # the context it attends to is the right K/V
            assert self.slots.get((seq.block_table[p // bs], p % bs)) == tuple(tokens[: p + 1]), (
                f"seq {seq.seq_id} reads wrong K/V at position {p}"
            )
        for p in range(start, start + num_new):
            block = seq.block_table[p // bs]
            assert self.kv.blocks[block].ref_count == 1, f"write into shared block {block}"
            self.slots[(block, p % bs)] = tuple(tokens[: p + 1])

    def _sample(self, seq: Sequence) -> None:
        seq.output_token_ids.append(next_token(seq))
        if seq.num_output_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= self.sched.max_model_len:
            self.finish(seq, SequenceStatus.FINISHED_LENGTH)
        elif self.rng.random() < self.finish_prob:
            self.finish(seq, SequenceStatus.FINISHED_STOPPED)

    def assert_drained(self) -> None:
        assert not self.live and not self.sched.has_unfinished()
        assert self.kv.num_free_blocks == self.kv.num_usable_blocks
        self.kv.check_invariants([])


def expected_output(prompt: list[int], n: int) -> list[int]:
    seq = make_seq(prompt)
    for _ in range(n):
        seq.output_token_ids.append(next_token(seq))
    return seq.output_token_ids


# ---- plain scenarios ----------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_while_a_decode_runs_every_step():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    short = make_seq([1, 2, 3], max_tokens=50)
    sim.add(short)
    sim.step()  # short's prefill; it samples its first token
    long = make_seq(list(range(30)), max_tokens=2)
    sim.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sim.step()
        assert out.scheduled[0].seq is short and out.scheduled[0].is_decode  # never stalled
        assert out.num_batched_tokens <= 8
        chunks.append(next(s.num_new_tokens for s in out.scheduled if s.seq is long))
    assert chunks == [7, 7, 7, 7, 2]
    assert long.num_output_tokens == 1


def test_a_burst_into_an_idle_engine_takes_the_prefill_only_budget_until_a_sequence_decodes():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=8, prefill_only_budget=20)
    burst = [make_seq([i] * 6, max_tokens=4) for i in range(4)]
    for seq in burst:
        sim.add(seq)
    out = sim.step()  # nobody decodes yet: 20 tokens, three whole prompts and two tokens of the fourth
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(burst[0], 6), (burst[1], 6), (burst[2], 6),
                                                                (burst[3], 2)]
    out = sim.step()  # three decodes now: back to 8 tokens, the rest of the fourth prompt in chunks
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(burst[0], 1), (burst[1], 1), (burst[2], 1),
                                                                (burst[3], 4)]
    sim.run()
    sim.assert_drained()
    assert all(s.output_token_ids == expected_output(s.prompt_token_ids, 4) for s in burst)
    late = make_seq([9] * 30, max_tokens=2)  # the engine is idle again: the next prompt gets 20 at once
    sim.add(late)
    assert [(s.seq, s.num_new_tokens) for s in sim.step().scheduled] == [(late, 20)]


def test_a_sliding_window_request_is_checked_against_the_largest_chunk_a_step_can_take():
    """With a window, a sequence holds its window plus one step's chunk; a prefill-only budget
    above the step budget makes that chunk larger, so admission counts it."""
    kv = KVCacheManager(6, 4, True)  # 5 usable blocks of 4
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=4, max_model_len=64, sliding_window=8)
    sched.add(make_seq(list(range(30)), max_tokens=10))  # window 8 + chunk 4: 3 blocks + 1
    sched.prefill_only_budget = 20  # window 8 + chunk 20: 7 blocks + 1 > 5
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        sched.add(make_seq(list(range(30)), max_tokens=10))


def test_a_prefill_only_budget_under_the_step_budget_changes_nothing():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, prefill_only_budget=4)
    seq = make_seq([1] * 12, max_tokens=2)
    sim.add(seq)
    assert sim.step().num_batched_tokens == 8


def test_admission_is_fcfs_and_respects_max_num_seqs_and_the_budget():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=10)
    seqs = [make_seq([i] * 6, max_tokens=3) for i in range(4)]
    for seq in seqs:
        sim.add(seq)
    out = sim.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(seqs[0], 6), (seqs[1], 4)]
    assert list(sim.sched.waiting) == seqs[2:]
    out = sim.step()  # seqs[0] decodes, seqs[1] finishes its prompt; the batch is full
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(seqs[0], 1), (seqs[1], 2)]
    sim.run()
    sim.assert_drained()
    assert all(s.output_token_ids == expected_output(s.prompt_token_ids, 3) for s in seqs)


def test_preemption_under_a_tiny_pool_frees_blocks_and_the_victim_later_completes():
    # 5 usable blocks of 4 tokens; each request grows to 16 tokens (4 blocks), so they collide.
    sim = Sim(num_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    seqs = [make_seq([10 + i] * 4, max_tokens=12) for i in range(3)]
    for seq in seqs:
        sim.add(seq)
    sim.run()
    sim.assert_drained()
    preempted = [s for out in sim.outputs for s in out.preempted]
    assert preempted and sim.sched.num_preemptions == len(preempted)
    assert sum(s.num_preemptions for s in seqs) == len(preempted)
    assert seqs[0].num_preemptions == 0  # the oldest is never the victim
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED_LENGTH
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 12)


def test_a_request_that_can_never_fit_is_refused_at_add_time():
    kv = KVCacheManager(num_blocks=6, block_size=4)  # 5 blocks = 20 tokens
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt 10 \+ max_tokens 20.*--kv-cache-memory"):
        sched.add(make_seq([1] * 10, max_tokens=20))
    with pytest.raises(ValueError, match=r"prompt has 64 tokens.*max_model_len is 64.*--max-model-len"):
        sched.add(make_seq([1] * 64, max_tokens=1))
    with pytest.raises(ValueError, match="no max_tokens.*--max-model-len"):
        sched.add(Sequence("r", [1] * 4, SamplingParams(max_tokens=None)))
    small = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=20)
    small.add(Sequence("r", [1] * 4, SamplingParams(max_tokens=None)))  # capped at 20 tokens: fits
    sched.add(make_seq([1] * 10, max_tokens=10))  # exactly the whole pool
    assert sched.num_waiting == 1 and not kv.usage


def test_the_batch_never_outgrows_the_token_budget_so_every_decode_runs_each_step():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=3)
    for i in range(6):
        sim.add(make_seq([i] * 5, max_tokens=4))
    while sim.sched.has_unfinished():
        sim.step()  # checks that no running decode is skipped
        assert sim.sched.num_running <= 3
    sim.assert_drained()


def test_abort_frees_blocks_at_once_and_drops_every_sample_of_the_request():
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    a0, a1 = make_seq([1] * 9, request_id="a"), make_seq([1] * 9, request_id="a")
    b, c = make_seq([2] * 9, request_id="b"), make_seq([3] * 9, request_id="c")
    for seq in (a0, a1, b, c):
        sim.add(seq)
    sim.step()  # a0 and a1 run; b and c wait
    assert sim.kv.usage > 0
    assert sorted(s.seq_id for s in sim.abort("a")) == sorted([a0.seq_id, a1.seq_id])
    assert a0.status is a1.status is SequenceStatus.FINISHED_ABORTED
    assert sim.kv.usage == 0 and sim.sched.num_running == 0
    assert sim.abort("b") == [b] and list(sim.sched.waiting) == [c]
    assert sim.abort("nope") == []
    sim.run()
    sim.assert_drained()


def test_a_sequence_aborted_while_its_step_runs_is_left_alone_by_update_after_step():
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    keep, gone = make_seq(STEMS[0][:9]), make_seq(STEMS[1][:9])
    sim.add(keep)
    sim.add(gone)
    out = sim.sched.schedule()
    sim.abort(gone.request_id)  # e.g. the client disconnected during the forward pass
    sim.sched.update_after_step(out)
    assert gone.num_computed_tokens == 0 and gone.block_table == []
    assert keep.num_computed_tokens == 9
    sim.kv.check_invariants(sim.live)
    assert sim.kv.num_cached_blocks == 2  # only keep's full blocks were registered


def test_a_follow_up_turn_hits_the_blocks_of_the_previous_output():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    turn1 = make_seq(STEMS[0][:10], max_tokens=9)
    sim.add(turn1)
    sim.run()
    turn2 = make_seq(turn1.token_ids + [5, 6, 7], max_tokens=2)
    sim.add(turn2)
    sim.step()
    # turn1 computed 18 of its 19 tokens: 4 full blocks; blocks 2 and 3 hold generated tokens.
    assert turn2.num_cached_tokens == 16
    sim.run()
    sim.assert_drained()


def test_with_prefix_caching_off_identical_prompts_share_nothing():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    first = make_seq(STEMS[1][:17], max_tokens=2)
    sim.add(first)
    sim.run()
    second = make_seq(STEMS[1][:17], max_tokens=2)
    sim.add(second)
    sim.run()
    assert second.num_cached_tokens == 0 and sim.kv.num_cached_blocks == 0
    sim.assert_drained()


# ---- randomized workloads -----------------------------------------------------------------

prompts = st.builds(
    lambda stem, k, tail: STEMS[stem][:k] + tail,
    st.integers(0, len(STEMS) - 1), st.integers(0, 24), st.lists(st.integers(0, 10), max_size=6),
).filter(bool)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(8, 40),
    max_num_seqs=st.integers(1, 5),
    extra_budget=st.integers(0, 24),
    requests=st.lists(st.tuples(prompts, st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=10),
    prefix_caching=st.booleans(),
    finish_prob=st.sampled_from([0.0, 0.1, 0.3]),
    seed=st.integers(0, 2**16),
    idle_extra=st.none() | st.integers(0, 24),
)
def test_random_workloads_keep_the_invariant_every_step_and_drain(
    block_size, num_blocks, max_num_seqs, extra_budget, requests, prefix_caching, finish_prob, seed, idle_extra,
):
    sim = Sim(num_blocks, block_size, max_num_seqs, max_num_seqs + extra_budget, max_model_len=40,
              enable_prefix_caching=prefix_caching, finish_prob=finish_prob, seed=seed,
              prefill_only_budget=None if idle_extra is None else max_num_seqs + extra_budget + idle_extra)
    arrivals: dict[int, list[Sequence]] = {}
    for prompt, max_tokens, arrive_at in requests:
        prompt = prompt[:39]
        seq = make_seq(prompt, max_tokens)
        total = min(len(prompt) + max_tokens, 40)
        if -(-total // block_size) > num_blocks - 1:
            with pytest.raises(ValueError, match="--kv-cache-memory"):
                sim.sched.add(seq)
            continue
        arrivals.setdefault(arrive_at, []).append(seq)
    for step in range(10_000):
        for seq in arrivals.pop(step, []):
            sim.add(seq)
        if not arrivals and not sim.sched.has_unfinished():
            break
        sim.step()
    sim.assert_drained()
    for seq in sim.finished:
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.num_output_tokens)
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == seq.sampling_params.max_tokens or seq.num_tokens == 40


class SchedulerMachine(RuleBasedStateMachine):
    """Any interleaving of add / step / abort / finish keeps the pool consistent, and once every
    sequence is gone all blocks are free."""

    def __init__(self) -> None:
        super().__init__()
        self.sim = Sim(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=6, max_model_len=40)

    @rule(prompt=prompts, max_tokens=st.integers(1, 10), n=st.integers(1, 2))
    def add(self, prompt, max_tokens, n):
        rid = f"req-{next(_ids)}"
        for _ in range(n):
            self.sim.add(make_seq(prompt[:30], max_tokens, request_id=rid))

    @rule()
    def step(self):
        self.sim.step()

    @precondition(lambda self: self.sim.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.sim.live))
        aborted = self.sim.abort(seq.request_id)
        assert seq in aborted and all(s.status is SequenceStatus.FINISHED_ABORTED for s in aborted)

    @precondition(lambda self: any(s.num_uncomputed_tokens == 1 and s.num_output_tokens for s in self.sim.sched.running))
    @rule(data=st.data())
    def finish(self, data):
        # Between steps the engine stops a sequence that just sampled (EOS, stop string).
        candidates = [s for s in self.sim.sched.running if s.num_uncomputed_tokens == 1 and s.num_output_tokens]
        self.sim.finish(data.draw(st.sampled_from(candidates)))

    @invariant()
    def pool_is_consistent(self):
        self.sim.kv.check_invariants(self.sim.live)
        assert self.sim.kv.num_free_blocks + round(self.sim.kv.usage * 11) == 11

    def teardown(self):
        self.sim.run()
        self.sim.assert_drained()


SchedulerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase
