"""Draft-model proposals: a smaller model with the target's tokenizer guesses k tokens ahead.

The draft keeps its own paged KV cache (its own ModelRunner and KVCacheManager, as many blocks
as the target's pool) and, per target sequence, a `_DraftSeq`: a view of the target's tokens
plus the proposals of the step in flight, with the draft's block table and computed count.

Proposing k tokens for a batch takes k draft forward passes: the first catches each draft
sequence up to the target's last token (a chunk, when earlier steps did not speculate or
accepted tokens the draft never computed) and samples x_1; each further pass is a batched
decode of x_j that samples x_{j+1}. After verification the draft keeps only K/V of tokens the
target accepted (at most the target's computed count) and trims the rest.

What the draft samples from: greedy requests take its argmax; sampling requests draw from its
distribution under the request's temperature/top-k/top-p/min-p, which is the q the verifier's
min(1, p/q) rule needs. Seeded sampling requests are verified as point masses instead (see
rejection.py), which keeps their tokens identical to plain decoding; the draft's own draws use
a generator of its own so they never touch the request's.
"""

from __future__ import annotations

import logging

import torch

from tessera.engine.kv_cache import KVCacheManager
from tessera.engine.model_runner import ModelRunner
from tessera.engine.request import Sequence
from tessera.engine.sampler import exponential_race
from tessera.spec.rejection import target_probs

logger = logging.getLogger("tessera")


class _DraftSeq:
    """The draft's copy of a target sequence, shaped like a Sequence for ModelRunner.prepare and
    KVCacheManager: token ids, computed count, block table."""

    __slots__ = ("seq_id", "target", "extra", "block_table", "num_computed_tokens")

    def __init__(self, target: Sequence) -> None:
        self.seq_id = target.seq_id
        self.target = target
        self.extra: list[int] = []  # proposals of the step in flight, after the target's tokens
        self.block_table: list[int] = []
        self.num_computed_tokens = 0

    @property
    def token_ids(self) -> list[int]:
        return self.target.token_ids + self.extra

    @property
    def num_tokens(self) -> int:
        return self.target.num_tokens + len(self.extra)

    @property
    def last_token_id(self) -> int:
        return self.extra[-1] if self.extra else self.target.last_token_id


class DraftProposer:
    """Proposes with a draft model over its own paged KV cache (see the module doc)."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.vocab_size = model.config.vocab_size
        self.generator = torch.Generator(device=model.device).manual_seed(0x5EED)
        self._seqs: dict[int, _DraftSeq] = {}
        self._probs: dict[int, torch.Tensor | None] = {}

    @classmethod
    def load(cls, path: str, dtype: torch.dtype, num_blocks: int, block_size: int, device: str = "cpu",
             quantization: str = "none") -> DraftProposer:
        from tessera.model.download import resolve_model_path
        from tessera.model.registry import build_model
        from tessera.model.weights import load_model_files

        files = load_model_files(resolve_model_path(path))
        # The lm_head quantized too: for small models it is the largest matmul of a decode step.
        model = build_model(files, dtype, device, quantization=quantization, quantize_lm_head=quantization != "none")
        return cls(model, num_blocks, block_size)

    # ---- proposing ---------------------------------------------------------------------------

    def propose(self, granted: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Up to k proposals for each (sequence, k); a sequence the draft pool cannot hold gets none."""
        self._probs = {}
        drafts: list[tuple[_DraftSeq, int]] = []
        for seq, k in granted:
            draft = self._seqs.get(seq.seq_id)
            if draft is None:
                draft = self._seqs[seq.seq_id] = _DraftSeq(seq)
            # Positions up to the target's last token plus k - 1 proposals get draft K/V.
            need = seq.num_tokens + k - 1 - draft.num_computed_tokens
            if not self.kv.allocate_slots(draft, need):
                self._evict(keep={s.seq_id for s, _ in granted})
                if not self.kv.allocate_slots(draft, need):
                    continue
            drafts.append((draft, k))
        if not drafts:
            return {}
        proposals: dict[int, list[int]] = {d.seq_id: [] for d, _ in drafts}
        probs: dict[int, list[torch.Tensor]] = {d.seq_id: [] for d, _ in drafts}
        active = drafts
        while active:
            # First pass: catch up (decodes first, then chunks); later passes: one token each.
            active.sort(key=lambda item: item[0].num_tokens - item[0].num_computed_tokens != 1)
            scheduled = [(d, d.num_tokens - d.num_computed_tokens) for d, _ in active]
            num_decodes = sum(1 for _, n in scheduled if n == 1)
            step = self.runner.prepare(scheduled, num_decodes)
            logits = self.runner.execute(step)
            for d, n in scheduled:
                d.num_computed_tokens += n
            tokens, rows = self._sample(logits, [d.target for d in step.sample_seqs])
            next_active = []
            for (d, k), token, row in zip(active, tokens, rows, strict=True):
                proposals[d.seq_id].append(token)
                if row is not None:
                    probs[d.seq_id].append(row)
                if len(proposals[d.seq_id]) < k:
                    d.extra.append(token)
                    next_active.append((d, k))
            active = next_active
        for d, _ in drafts:
            d.extra = []
            rows = probs[d.seq_id]
            self._probs[d.seq_id] = torch.stack(rows) if rows else None
        return proposals

    def _sample(self, logits: torch.Tensor, targets: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row, and the distribution q it was drawn from (None: a point mass,
        for greedy requests and for seeded ones, which are verified as point masses)."""
        tokens = logits.argmax(dim=-1).tolist()
        rows: list[torch.Tensor | None] = [None] * len(targets)
        sampled = [i for i, t in enumerate(targets) if not t.sampling_params.is_greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            q = target_probs(logits[index], [targets[i].sampling_params for i in sampled])
            drawn = exponential_race(q, [None] * len(sampled), self.generator).tolist()
            for j, i in enumerate(sampled):
                tokens[i] = drawn[j]
                if targets[i].sampling_params.seed is None:
                    rows[i] = q[j]
        return tokens, rows

    def draft_probs(self, seq_id: int) -> torch.Tensor | None:
        """[k, V] q of this step's proposals for seq_id, or None when they are point masses."""
        return self._probs.get(seq_id)

    # ---- after verification ------------------------------------------------------------------

    def rollback(self, seq: Sequence) -> None:
        """Keep draft K/V only for tokens the target accepted; free the blocks past them."""
        draft = self._seqs.get(seq.seq_id)
        if draft is None:
            return
        draft.num_computed_tokens = min(draft.num_computed_tokens, seq.num_computed_tokens)
        self.kv.trim(draft, draft.num_computed_tokens)

    def forget(self, seq_id: int) -> None:
        draft = self._seqs.pop(seq_id, None)
        if draft is not None:
            self.kv.free(draft)
        self._probs.pop(seq_id, None)

    def _evict(self, keep: set[int]) -> None:
        """Free the draft K/V of sequences not speculating now (they catch up if they return)."""
        for seq_id in [sid for sid in self._seqs if sid not in keep]:
            self.forget(seq_id)

    def check_invariants(self) -> None:
        self.kv.check_invariants(self._seqs.values())
