"""The continuous-batching scheduler: which sequences run this step, and how many tokens each.

Iteration-level batching in the vLLM v1 style, over Python objects only. Every step has a token
budget (max_num_batched_tokens). Running sequences are served first, oldest first: every decode
takes one token, and the one sequence still in its prefill (always the newest) takes a chunk of
what is left, so a long prompt never stalls tokens already streaming. Then waiting sequences are
admitted first-come first-served while the batch (max_num_seqs) and the budget allow, each with
a prefill chunk of at most the remaining budget (chunked prefill).

KV blocks are taken as tokens arrive, never reserved for the maximum output. When a running
sequence cannot get a block, the newest running sequence is preempted and goes back to the
front of the queue: in recompute mode its blocks are freed and its tokens, outputs included,
are computed again (the prefix cache usually revives most of them); in swap mode (see
tessera.engine.swap) its computed blocks are first copied to the host pool, and copied back
into fresh device blocks when it is admitted again. The PreemptionPolicy picks per victim.

Engine protocol, once per step:
    out = scheduler.schedule()
    run the model on out.scheduled (decodes first; a seq samples iff item.samples)
    copy out.swap_out (device -> host), then out.swap_in (host -> device), before the forward pass
    scheduler.update_after_step(out)            # advance num_computed_tokens, cache full blocks
    for each seq that sampled: append the token, check stop conditions, and if it stops
        scheduler.finish(seq, status)           # frees its blocks at once
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tessera.engine.kv_cache import KVCacheManager
from tessera.engine.request import Sequence, SequenceStatus
from tessera.engine.swap import HostBlockPool, PreemptionPolicy


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: it computes tokens num_computed_tokens .. +num_new_tokens."""

    seq: Sequence
    num_new_tokens: int
    # The chunk reaches the end of the sequence, so the step samples its next token. Fixed at
    # schedule time: update_after_step() moves num_computed_tokens on.
    samples: bool = field(init=False)
    # Speculative decoding: KV slots also taken for this many proposed tokens after the last
    # one (the step verifies them); the engine rolls back the ones the target rejects.
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        self.samples = self.num_new_tokens == self.seq.num_uncomputed_tokens

    @property
    def is_decode(self) -> bool:
        """One token, the last one: shaped like a decode (a 1-token final prefill chunk too)."""
        return self.samples and self.num_new_tokens == 1 and not self.num_lookahead_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefill chunks
    preempted: list[Sequence] = field(default_factory=list)
    # Block copies the engine runs before the forward pass, swap-outs first: (device block, host
    # block) for preempted sequences and demoted cached blocks, (host block, device block) for
    # resumed sequences and promoted prefix hits.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)


class Scheduler:
    """Owns the waiting queue and the running batch; decides each step's work (see module doc)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, host: HostBlockPool | None = None,
                 preemption: PreemptionPolicy | None = None, sliding_window: int | None = None) -> None:
        self.kv = kv
        # Every layer of the model attends to at most this many positions (None: some layer
        # reads the whole context): blocks behind it are freed before each step.
        self.sliding_window = sliding_window
        self.host = host  # the host KV pool, None without --swap-space
        if host is not None:
            kv.attach_host_tier(host)  # evicted cached blocks are demoted there, hits promoted back
        self.preemption = preemption or PreemptionPolicy("recompute")
        self._swap_out: list[tuple[int, int]] = []  # this step's copies, handed out by schedule()
        self._swap_in: list[tuple[int, int]] = []
        # A batch never holds more sequences than one step has tokens: every running sequence
        # decodes every step, none waits for the others' turn.
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        # The budget of a step in which no running sequence decodes (None: max_num_batched_tokens).
        # A budget cut to keep chunks short next to decodes (the autopilot's) protects nobody in
        # such a step: the first step of a burst into an idle engine would only be split into
        # more steps, and each later step's decodes would then wait next to the rest of the burst.
        self.prefill_only_budget: int | None = None
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the newest is last
        self.num_preemptions = 0

    # ---- queue --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ValueError if it could never run (see _check_fits)."""
        self._check_fits(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _check_fits(self, seq: Sequence) -> None:
        n = seq.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len} (prompt plus at "
                f"least one output token); shorten the prompt or raise --max-model-len"
            )
        max_tokens = seq.sampling_params.max_tokens
        total = self.max_model_len if max_tokens is None else min(n + max_tokens, self.max_model_len)
        needed = self.kv.num_blocks_for(total)
        if self.sliding_window is not None:  # blocks behind the window are freed as it moves
            chunk = max(self.max_num_batched_tokens, self.prefill_only_budget or 0)  # a step's largest
            needed = min(needed, self.kv.num_blocks_for(self.sliding_window + chunk) + 1)
        if needed > self.kv.num_usable_blocks:
            asked = f"prompt {n} + max_tokens {max_tokens}" if max_tokens is not None else f"prompt {n}, no max_tokens"
            raise ValueError(
                f"the request can grow to {total} tokens ({asked}, capped at max_model_len "
                f"{self.max_model_len}), {needed} KV blocks, but the whole KV cache holds "
                f"{self.kv.num_usable_blocks} blocks of {self.kv.block_size} tokens; raise --kv-cache-memory, "
                f"or lower max_tokens or --max-model-len"
            )

    def add_running(self, seq: Sequence) -> None:
        """Take in a sequence that already holds its blocks and only decodes (imported from
        another engine): ahead of a sequence still in its prefill, which must stay the newest."""
        seq.status = SequenceStatus.RUNNING
        at = len(self.running)
        while at and self.running[at - 1].num_uncomputed_tokens > 1:
            at -= 1
        self.running.insert(at, seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request as aborted and free its blocks; return them."""
        seqs = [s for s in (*self.running, *self.waiting) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark seq finished with `status` (decided by the engine), drop it, free its blocks."""
        assert status.is_finished, status
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = status
        self.kv.free(seq)
        if self.host is not None:
            self.host.release(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- the step -----------------------------------------------------------------------

    def schedule(self, lookahead: dict[int, int] | None = None) -> SchedulerOutput:
        """Pick this step's batch: running sequences oldest first, then waiting ones FCFS.

        No running decode is ever stalled by a long prompt: the budget covers a decode for every
        running sequence (max_num_seqs <= max_num_batched_tokens), and at most one running
        sequence is in the middle of its prefill, the newest (its last chunk took all the budget
        that was left, so nobody was admitted after it), so it is served after every decode.
        A step that had to preempt admits nobody: the pool is full.

        lookahead (speculative decoding): seq_id -> proposed tokens a decoding sequence wants
        to verify this step. Granted last, from the budget and free blocks left over: it never
        preempts anyone nor delays an admission (see _grant_lookahead).
        """
        budget = self._step_budget()
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        self._swap_out, self._swap_in = [], []
        if self.host is not None:
            self.host.begin_step()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted in this step to make room for an older sequence
            num_new = min(self._num_uncomputed(seq), budget)
            if self.sliding_window is not None:
                # This step's queries start at num_computed_tokens; the first key any of them
                # reads is sliding_window - 1 positions before that.
                self.kv.release_before(seq, seq.num_computed_tokens - self.sliding_window + 1)
            if self._allocate_or_preempt(seq, num_new, preempted):
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        if not preempted:
            self._admit_waiting(budget, scheduled)
            if lookahead:
                self._grant_lookahead(scheduled, lookahead)
        self._collect_block_copies()
        # A host block taken twice in one step (a demotion's block dropped again for a later
        # swap-out or demotion) is copied into once: by its last owner. One index_copy_ with a
        # repeated destination keeps an arbitrary one of the rows.
        last_copy = {host_block: (device_block, host_block) for device_block, host_block in self._swap_out}
        return SchedulerOutput(
            scheduled=[s for s in scheduled if s.is_decode] + [s for s in scheduled if not s.is_decode],
            preempted=preempted,
            swap_out=list(last_copy.values()),
            swap_in=self._swap_in,
        )

    def _step_budget(self) -> int:
        """max_num_batched_tokens, or prefill_only_budget when no running sequence has only its
        last token left (one whose next token is a decode: the chunks would delay it)."""
        idle = self.prefill_only_budget
        if idle is None or idle <= self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        if any(s.num_uncomputed_tokens <= 1 for s in self.running if s.status is SequenceStatus.RUNNING):
            return self.max_num_batched_tokens
        return idle

    def _collect_block_copies(self) -> None:
        """Append the demotions and promotions the block manager decided so far, keeping the
        device -> host copies in the order they were decided (see schedule's last copy)."""
        demotions, promotions = self.kv.take_block_copies()
        self._swap_out.extend(demotions)
        self._swap_in.extend(promotions)

    def _grant_lookahead(self, scheduled: list[ScheduledSeq], lookahead: dict[int, int]) -> None:
        spare = self.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
        for item in scheduled:
            k = min(lookahead.get(item.seq.seq_id, 0), spare)
            if k > 0 and item.is_decode and self.kv.allocate_slots(item.seq, 1 + k):
                item.num_lookahead_tokens = k
                spare -= k

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
        """Get seq's blocks for num_new more tokens, preempting the newest running sequences
        (never one already scheduled this step: those are older) until they fit. Returns False
        if seq itself had to go."""
        while not self.kv.allocate_slots(seq, num_new):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                # Alone with the whole pool and still no room: add() should have refused it.
                raise RuntimeError(
                    f"sequence {seq.seq_id} ({seq.num_tokens} tokens) cannot fit the whole KV cache "
                    f"({self.kv.num_usable_blocks} blocks of {self.kv.block_size}); raise --kv-cache-memory"
                )
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.preemption.should_swap(seq, self.host, self._num_shared_prefix_tokens(seq)):
            self._collect_block_copies()  # earlier demotions first: this swap-out may retake their host blocks
            self._swap_out.extend(self.host.swap_out(seq))  # before free: the pairs name its blocks
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._allocate_for_admission(seq, budget):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _allocate_for_admission(self, seq: Sequence, budget: int) -> bool:
        """kv.allocate_for_admission, and for a sequence swapped out to the host pool, the
        copies that bring back its saved blocks the prefix cache does not cover."""
        if self.host is None or not self.host.holds(seq):
            return self.kv.allocate_for_admission(seq, budget)
        if not self.kv.allocate_for_admission(seq, budget, self.host.num_saved_tokens(seq)):
            return False
        self._swap_in.extend(self.host.swap_in(seq, seq.num_cached_tokens // self.kv.block_size))
        return True

    def _num_shared_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens in seq's leading computed blocks that another sequence also holds: they stay
        cached on the device, so recomputing seq would get them back from the prefix cache."""
        if not self.kv.enable_prefix_caching:
            return 0
        num_full = seq.num_computed_tokens // self.kv.block_size
        shared = 0
        for block_id in seq.block_table[:num_full]:
            if self.kv.blocks[block_id].ref_count < 2:
                break
            shared += 1
        return shared * self.kv.block_size

    @staticmethod
    def _num_uncomputed(seq: Sequence) -> int:
        n = seq.num_uncomputed_tokens
        if n <= 0:
            raise RuntimeError(
                f"sequence {seq.seq_id} is running with nothing to compute: after a step that sampled, "
                f"the engine must append the token or call finish()"
            )
        return n

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Record that the step computed its tokens: advance each scheduled sequence's
        num_computed_tokens and register its newly full blocks in the prefix cache.

        Call after the forward pass, before appending sampled tokens or finishing sequences.
        Sequences aborted since schedule() are skipped (their blocks are already free).
        """
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit_computed(seq)
