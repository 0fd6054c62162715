"""Speculative decoding inside the engine step: plan, propose, verify, roll back, measure.

One engine step with speculation on:

    lookahead = spec.plan(running)            # controller: seq_id -> k (0 = plain decode)
    out = scheduler.schedule(lookahead)       # KV slots for 1 + k tokens, if free and in budget
    spec_tokens = spec.propose(out.scheduled) # seq_id -> the k proposed tokens
    runner: each speculating sequence is a query of k+1 tokens (its last token + proposals)
            attending causally to its context, with logits at all k+1 rows
    scheduler.update_after_step(out)          # counts the last token only
    spec.sample(...)                          # plain rows -> Sampler, speculating -> verify
    engine appends the accepted tokens one by one (stop conditions per token)
    spec.rollback()                           # accepted K/V counted, prefix-cached; the rest trimmed
    spec.record_step(...)                     # step time -> the controller's cost model

Sequences whose sampling uses penalties or logprobs never speculate: penalties depend on
every earlier token (the rows after a proposal would need the proposal counted in), and the
logprobs of rejected rows would have to be thrown away with care. Both are rare next to the
cost of getting them subtly wrong.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from tessera.engine.kv_cache import KVCacheManager
from tessera.engine.request import Sequence
from tessera.engine.sampler import Sampler
from tessera.sampling import SamplingParams
from tessera.spec.controller import Candidate, SpeculationController
from tessera.spec.ngram import NgramProposer
from tessera.spec.rejection import verify
from tessera.structured.bitmask import TokenMask, apply_bitmask

SPECULATIVE_METHODS = ("ngram", "draft")
# Acceptance assumed for an n-gram match-length bucket before any verification of it: a one-token
# match is mostly a guess, a 16-token one mostly a copy. Measured acceptance replaces it quickly.
_NGRAM_PRIORS = (0.0, 0.15, 0.3, 0.45, 0.6, 0.7, 0.75)


def can_speculate(params: SamplingParams) -> bool:
    return not params.uses_penalties and params.logprobs is None


@dataclass
class SpecStats:
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0  # sequence-steps that verified proposals
    num_steps_on: int = 0  # decode steps in which at least one sequence speculated
    num_steps_off: int = 0  # decode steps with speculation enabled but no sequence speculating
    time_on_s: float = 0.0
    time_off_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted proposals per verification (each verification also yields one target token)."""
        return self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0


class SpeculativeDecoder:
    """Owns the proposer, the controller and the per-step speculation state of an engine."""

    def __init__(self, method: str, num_speculative_tokens: int, adaptive: bool, kv: KVCacheManager,
                 max_model_len: int, proposer=None) -> None:
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-method {method!r}: choose one of {', '.join(SPECULATIVE_METHODS)}")
        self.method = method
        self.max_k = num_speculative_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else NgramProposer()
        self.controller = SpeculationController(num_speculative_tokens, adaptive)
        self.stats = SpecStats()
        self._ngram: dict[int, list[int]] = {}  # this step's n-gram proposals, by seq_id
        self._keys: dict[int, object] = {}  # this step's acceptance key of each candidate
        self._plan_batch = 0
        self._verified: list[tuple[Sequence, int]] = []  # (seq, accepted) of this step

    @classmethod
    def from_config(cls, config, kv: KVCacheManager, max_model_len: int, num_blocks: int,
                    dtype: torch.dtype, vocab_size: int) -> SpeculativeDecoder:
        """The decoder an EngineConfig asks for; a draft model gets its own paged KV pool of
        num_blocks blocks (as many tokens as the target's)."""
        proposer = None
        if config.speculative_method == "draft":
            from tessera.spec.draft import DraftProposer

            path = config.model if config.draft_model == "self" else config.draft_model
            proposer = DraftProposer.load(path, dtype, num_blocks, config.block_size, config.device,
                                          config.draft_quantization)
            if proposer.vocab_size != vocab_size:
                raise ValueError(
                    f"--draft-model {config.draft_model} has a vocabulary of {proposer.vocab_size} tokens but the "
                    f"target's has {vocab_size}: the draft must share the target's tokenizer"
                )
        return cls(config.speculative_method, config.num_speculative_tokens, config.speculative_adaptive, kv,
                   max_model_len, proposer)

    def set_max_k(self, k: int) -> None:
        """Speculate at most k tokens per sequence from the next step on (the measured costs stay)."""
        self.max_k = k
        self.controller.set_max_k(k)

    def engine_stats(self) -> dict:
        """The spec_* fields of EngineStats."""
        s = self.stats
        return dict(spec_num_proposed_tokens=s.num_proposed_tokens, spec_num_accepted_tokens=s.num_accepted_tokens,
                    spec_acceptance_rate=s.acceptance_rate, spec_mean_accepted_length=s.mean_accepted_length,
                    spec_num_steps_on=s.num_steps_on, spec_num_steps_off=s.num_steps_off,
                    spec_time_on_s=s.time_on_s, spec_time_off_s=s.time_off_s)

    # ---- before the forward pass ----------------------------------------------------------

    def plan(self, running: list[Sequence]) -> dict[int, int]:
        """How many tokens each decoding sequence may speculate this step (seq_id -> k > 0)."""
        candidates: list[Candidate] = []
        self._ngram.clear()
        self._keys.clear()
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or not can_speculate(seq.sampling_params):
                continue  # still in its prefill, or a request we do not speculate for
            cap = self._cap(seq)
            if cap <= 0:
                continue
            if self.method == "ngram":
                proposal, match = self.proposer.propose_with_match(seq, cap)
                if not proposal:
                    continue
                self._ngram[seq.seq_id] = proposal
                # Acceptance is tracked per match length (1, 2-3, 4-7, 8-15, 16-31, 32+): a text
                # copying a passage matches long and is accepted far more often than a guess.
                bucket = match.bit_length()
                key: object = ("ngram", seq.seq_id, bucket)
                group: object = ("ngram-match", bucket)
                prior = _NGRAM_PRIORS[min(bucket, len(_NGRAM_PRIORS) - 1)]
            else:
                key, group, prior = ("draft", seq.seq_id), "draft", None
            self._keys[seq.seq_id] = key
            candidates.append(Candidate(seq.seq_id, cap, key, group, prior))
        self._plan_batch = len(running)
        return self.controller.choose(candidates, len(running))

    def _cap(self, seq: Sequence) -> int:
        """At most k, and never past max_tokens or the context (the target adds one token too)."""
        cap = min(self.max_k, self.max_model_len - seq.num_tokens - 1)
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            cap = min(cap, max_tokens - seq.num_output_tokens - 1)
        return cap

    def propose(self, scheduled) -> dict[int, list[int]]:
        """The proposals of the sequences the scheduler gave lookahead slots (seq_id -> tokens)."""
        granted = [(item.seq, item.num_lookahead_tokens) for item in scheduled if item.num_lookahead_tokens]
        if not granted:
            return {}
        if self.method == "ngram":
            return {seq.seq_id: self._ngram[seq.seq_id][:k] for seq, k in granted}
        proposals = self.proposer.propose(granted)
        for seq, _ in granted:
            if not proposals.get(seq.seq_id):
                self.kv.trim(seq, seq.num_tokens)  # no proposal after all: give the lookahead back
        return proposals

    # ---- after the forward pass -----------------------------------------------------------

    def sample(self, sample_seqs: list[Sequence], logits: torch.Tensor, spec_tokens: dict[int, list[int]],
               sampler: Sampler, generators: dict[int, torch.Generator], eos_token_ids: Collection[int],
               token_mask: TokenMask | None = None):
        """Tokens for every sampling sequence of the step: (seqs, token id lists, logprobs).

        `sample_seqs` names the sequence of each logits row; a speculating sequence owns k+1
        consecutive rows. Plain rows go through the Sampler, speculating ones through verify().
        `token_mask` (structured outputs) masks every row first, a speculating row j with its
        grammar state after j proposals: a proposal the grammar forbids has probability 0 there
        and is rejected, so accepted tokens always follow the grammar.
        """
        if token_mask is not None:
            logits = apply_bitmask(logits.float(), token_mask.bitmask, token_mask.rows)
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        order: list[tuple[Sequence, bool]] = []  # each sequence once, in row order
        row = 0
        while row < len(sample_seqs):
            seq = sample_seqs[row]
            proposal = spec_tokens.get(seq.seq_id)
            if proposal:
                spec_rows.extend(range(row, row + len(proposal) + 1))
                row += len(proposal) + 1
            else:
                plain_rows.append(row)
                row += 1
            order.append((seq, bool(proposal)))
        plain_seqs = [seq for seq, speculating in order if not speculating]
        spec_seqs = [seq for seq, speculating in order if speculating]
        plain_tokens = iter([])
        plain_logprobs = iter([])
        if plain_seqs:
            sampled = sampler.sample(
                logits[torch.tensor(plain_rows)] if spec_rows else logits,
                [s.sampling_params for s in plain_seqs],
                [s.output_token_ids for s in plain_seqs],
                [s.prompt_token_ids for s in plain_seqs],
                [generators.get(s.seq_id) for s in plain_seqs],
                eos_token_ids=eos_token_ids,
            )
            plain_tokens = iter([[t] for t in sampled.token_ids])
            plain_logprobs = iter(sampled.logprobs)
        proposals = [spec_tokens[s.seq_id] for s in spec_seqs]
        result = verify(
            logits[torch.tensor(spec_rows)] if plain_rows else logits,
            proposals,
            [s.sampling_params for s in spec_seqs],
            [s.num_output_tokens for s in spec_seqs],
            [generators.get(s.seq_id) for s in spec_seqs],
            draft_probs=[self.proposer.draft_probs(s.seq_id) for s in spec_seqs] if self.method == "draft" else None,
            eos_token_ids=eos_token_ids,
        )
        self._verified = list(zip(spec_seqs, result.num_accepted, strict=True))
        stats = self.stats
        for seq, proposal, m in zip(spec_seqs, proposals, result.num_accepted, strict=True):
            stats.num_proposed_tokens += len(proposal)
            stats.num_accepted_tokens += m
            stats.num_verifications += 1
            self.controller.record_verification(self._keys[seq.seq_id], len(proposal), m)
        spec_tokens_out = iter(result.token_ids)
        seqs, token_ids, logprobs = [], [], []
        for seq, speculating in order:
            seqs.append(seq)
            if speculating:
                token_ids.append(next(spec_tokens_out))
                logprobs.append(None)
            else:
                token_ids.append(next(plain_tokens))
                logprobs.append(next(plain_logprobs))
        return seqs, token_ids, logprobs

    def rollback(self) -> None:
        """After the accepted tokens were appended: count their K/V as computed (and register
        the blocks they filled in the prefix cache), and free the blocks that held only
        rejected proposals. Finished sequences already gave all their blocks back."""
        for seq, accepted in self._verified:
            if seq.is_finished:
                continue
            seq.num_computed_tokens += accepted
            self.kv.commit_computed(seq)
            self.kv.trim(seq, seq.num_tokens)
            if self.method == "draft":
                self.proposer.rollback(seq)
        self._verified = []

    def record_step(self, scheduled, seconds: float) -> None:
        """Feed a finished step's time to the controller and the on/off metrics. Only steps of
        decodes (plain or speculating) of the batch that was planned are measured."""
        if len(scheduled) != self._plan_batch:
            return
        if any(not item.samples or item.num_new_tokens != 1 for item in scheduled):
            return  # a prefill chunk: its cost says nothing about decoding
        num_speculating = sum(1 for item in scheduled if item.num_lookahead_tokens)
        if num_speculating:
            self.stats.num_steps_on += 1
            self.stats.time_on_s += seconds
        else:
            self.stats.num_steps_off += 1
            self.stats.time_off_s += seconds
        self.controller.record_step(self._plan_batch, num_speculating, seconds)

    def check_invariants(self) -> None:
        """The draft model's own KV pool, when there is one."""
        if self.method == "draft":
            self.proposer.check_invariants()

    def forget(self, seq_id: int) -> None:
        """A sequence finished or was aborted: drop what was kept about it."""
        self.proposer.forget(seq_id)
        self.controller.forget(seq_id)
