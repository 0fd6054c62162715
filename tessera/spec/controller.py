"""Adaptive control: how many tokens each sequence speculates this step, 0 included.

Speculation pays when the tokens it gains are worth more than the step time it adds. Both
sides are measured, not assumed:

- acceptance a: the probability that a proposed token is accepted given that the ones before it
  were, from recent verifications (decayed counts of accepted tokens and rejections). Counts are
  kept per key within a group, and a key's estimate is shrunk toward its group's while it has
  few trials: for n-gram proposals the key is (request, length of the match the proposal comes
  from) in the group of that match length over all requests (a 20-token match means the text is
  copying a passage, a 1-token match is a guess; and a request that is rewriting its prompt gets
  short matches accepted too), for a draft model the request in the group of all requests.
  Decisions use the estimate plus one standard error, so a key is not dropped on the strength
  of one unlucky verification. With k proposals a verification yields (1 - a^(k+1)) / (1 - a)
  tokens in expectation, bonus token included.
- cost, per batch-size bucket: t0, the time of a plain decode step, and c(k), the time one
  sequence speculating k tokens adds to a step, both moving averages of measured step times
  (steps that carry prefill chunks are not measured). A c(k) not measured yet is read off the
  measured ones: interpolated between them, and beyond them taken equal to the nearest one.
  That guess is optimistic (verifying more tokens rarely costs less), so a k that might pay gets
  tried, measured, and dropped if it does not: exploration costs a step or two per bucket.

Each step the controller picks the k and the set S of sequences (those with the best expected
gain first) that maximise tokens per second, (B + sum over S of (E_i(k) - 1)) / (t0 + |S| c(k)).
k = 0 (plain decoding) competes on equal terms, so speculation switches off under large
batches or low acceptance. The first verification in a bucket, and the retries of a key whose
candidates are left out (now and then, with one sequence, less often each time, up to every
max_probe_interval steps, so speculation comes back when acceptance does), use a short k.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verification of k proposals yields in expectation: 1 + a + ... + a^k."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def batch_bucket(batch_size: int) -> int:
    """Costs are kept per bucket: exact up to 4 sequences, then powers of two (8, 16, 32...)."""
    return batch_size if batch_size <= 4 else 1 << (batch_size - 1).bit_length()


@dataclass
class Candidate:
    """A sequence that could speculate this step."""

    seq_id: int
    max_k: int  # the most tokens it can speculate now (proposal length, max_tokens, context)
    key: Hashable  # whose acceptance statistics apply (e.g. this request's n-gram matches of this length)
    group: Hashable | None = None  # a coarser key whose estimate is the key's prior (all requests' ...)
    prior: float | None = None  # the group's (or key's) acceptance before any data; None: the controller's


@dataclass
class _Acceptance:
    prior: float
    group: Hashable | None = None  # when set, the group's current estimate replaces `prior`
    accepted: float = 0.0  # decayed count of accepted proposals
    trials: float = 0.0  # decayed count of accepted proposals + rejections
    probe_interval: int = 0
    next_probe: int = 0


@dataclass
class _BucketCosts:
    plain: float | None = None  # seconds of a plain decode step
    extra: dict[int, float] = field(default_factory=dict)  # k -> seconds one speculating sequence adds

    def extra_cost(self, k: int) -> float | None:
        """c(k): measured, else interpolated, else the nearest measured one; None if none is."""
        if k in self.extra:
            return self.extra[k]
        known = sorted(self.extra)
        if not known:
            return None
        if k < known[0]:
            return self.extra[known[0]]
        if k > known[-1]:
            return self.extra[known[-1]]
        hi = next(j for j in known if j > k)
        lo = max(j for j in known if j < k)
        w = (k - lo) / (hi - lo)
        return (1 - w) * self.extra[lo] + w * self.extra[hi]


class SpeculationController:
    """Chooses per-step speculation lengths from measured acceptance and step costs."""

    def __init__(self, max_k: int, adaptive: bool = True, prior_acceptance: float = 0.5, prior_weight: float = 2.0,
                 decay: float = 0.9, cost_smoothing: float = 0.3, probe_interval: int = 8,
                 max_probe_interval: int = 4096, min_probe_gain: float = 1.5, probe_k: int = 4,
                 retry_k: int = 2) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.decay = decay
        self.cost_smoothing = cost_smoothing
        self.base_probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.min_probe_gain = min_probe_gain  # expected extra tokens that justify a first probe
        # Probes verify few tokens: on a CPU a long verification costs several plain steps, and a
        # probe that finds nothing should cost about one. Longer k are explored once it pays.
        self.probe_k = min(probe_k, max_k)
        # Retries of a left-out key start soon (probe_interval steps) and back off exponentially.
        # A key's first verification decides a lot: one rejection takes a fresh n-gram match
        # length from its prior 0.3 to 0.13, below what pays, and with retries every 256 steps
        # (the old default) it was never measured again within a request: on a 128-token code
        # rewrite at batch 1 the 2-3 and 4-7 token matches (accepted ~0.7-0.9 per proposal with
        # k fixed) were dropped after one unlucky verification each and speculation ran in 16% of
        # steps. A retry with nothing else speculating verifies only retry_k tokens: it is a
        # fraction of a plain step where the key still does not pay (open-ended text). Intervals
        # are in steps per sequence of the batch (probe_interval * batch size steps): each
        # sequence has keys of its own, so the retries per step stay as few under a large batch
        # (at batch 16 with 8-step intervals, stories speculated in 27% of steps, 0.89x).
        self.retry_k = min(retry_k, max_k)
        self._wanted_probe_k, self._wanted_retry_k = probe_k, retry_k
        self._batch_size = 1
        self._acceptance: dict[Hashable, _Acceptance] = {}
        self._keys_of_seq: dict[int, set[Hashable]] = {}
        self._costs: dict[int, _BucketCosts] = {}
        self._step = 0
        self._last_k = 0  # the k of the last plan: what its step time is attributed to

    def set_max_k(self, max_k: int) -> None:
        """A new upper bound on k (the costs measured for each k stay valid)."""
        self.max_k = max_k
        self.probe_k = min(self._wanted_probe_k, max_k)
        self.retry_k = min(self._wanted_retry_k, max_k)

    # ---- estimates ---------------------------------------------------------------------------

    def acceptance(self, key: Hashable) -> float:
        """The key's estimate, shrunk toward its group's (or its prior) while it has few trials."""
        s = self._acceptance.get(key)
        if s is None:
            return self.prior_acceptance
        prior = self.acceptance(s.group) if s.group is not None else s.prior
        return (s.accepted + prior * self.prior_weight) / (s.trials + self.prior_weight)

    def _stats(self, key: Hashable, candidate: Candidate | None = None) -> _Acceptance:
        s = self._acceptance.get(key)
        if s is None:
            prior = self.prior_acceptance if candidate is None or candidate.prior is None else candidate.prior
            group = candidate.group if candidate is not None else None
            if group is not None:
                self._stats(group, Candidate(candidate.seq_id, 0, group, None, candidate.prior))
            s = self._acceptance[key] = _Acceptance(prior=prior, group=group,
                                                    next_probe=self._step + self._base_interval())
            if candidate is not None and group is not None:
                self._keys_of_seq.setdefault(candidate.seq_id, set()).add(key)
        return s

    def optimistic_acceptance(self, key: Hashable) -> float:
        """The estimate plus one standard error: what decisions use, so that a key judged on a
        verification or two (one unlucky rejection) gets another chance before it is dropped.
        The evidence counted is the key's own trials plus its group's, which its estimate
        starts from: a new key of a well-measured group is not treated as unknown."""
        a = self.acceptance(key)
        s = self._acceptance.get(key)
        trials = 0.0
        while s is not None:
            trials += s.trials
            s = self._acceptance.get(s.group) if s.group is not None else None
        return min(1.0, a + (a * (1.0 - a) / (trials + self.prior_weight)) ** 0.5)

    def costs(self, batch_size: int) -> _BucketCosts:
        return self._costs.setdefault(batch_bucket(batch_size), _BucketCosts())

    # ---- the decision ------------------------------------------------------------------------

    def choose(self, candidates: list[Candidate], batch_size: int) -> dict[int, int]:
        """seq_id -> k > 0 for the candidates that speculate this step.

        batch_size: the running sequences this step (candidates or not).
        """
        self._step += 1
        self._last_k = 0
        self._batch_size = max(batch_size, 1)
        for c in candidates:
            self._stats(c.key, c)
        if not candidates:
            return {}
        if not self.adaptive:
            self._last_k = self.max_k
            return {c.seq_id: c.max_k for c in candidates}
        costs = self.costs(batch_size)
        if costs.plain is None:
            return {}  # measure a plain step of this bucket first
        gains = {c.seq_id: [expected_tokens(self.optimistic_acceptance(c.key), min(k, c.max_k)) - 1.0
                            for k in range(self.max_k + 1)] for c in candidates}
        if not costs.extra:
            # Nothing measured in this bucket: one sequence, the most promising, at a short k.
            best = max(candidates, key=lambda c: gains[c.seq_id][self.probe_k])
            if gains[best.seq_id][self.probe_k] < self.min_probe_gain:
                return {}
            self._last_k = min(self.probe_k, best.max_k)
            return {best.seq_id: self._last_k}
        best_rate, best_k, best_set = batch_size / costs.plain, 0, []
        for k in range(1, self.max_k + 1):
            extra = costs.extra_cost(k)
            ranked = sorted(candidates, key=lambda c: gains[c.seq_id][k], reverse=True)
            total = 0.0
            for n, c in enumerate(ranked, 1):
                total += gains[c.seq_id][k]
                rate = (batch_size + total) / (costs.plain + n * extra)
                if rate > best_rate:
                    best_rate, best_k, best_set = rate, k, ranked[:n]
        plan = {c.seq_id: min(best_k, c.max_k) for c in best_set}
        self._probe_left_out(candidates, plan, best_k)
        self._last_k = best_k or max(plan.values(), default=0)
        return plan

    def _base_interval(self) -> int:
        return self.base_probe_interval * self._batch_size

    def _probe_left_out(self, candidates: list[Candidate], plan: dict[int, int], best_k: int) -> None:
        """Each acceptance key with no candidate in the plan is tried with one sequence now and
        then, at exponentially growing intervals; a key that is in the plan resets its interval."""
        chosen = {c.key for c in candidates if c.seq_id in plan}
        for c in candidates:
            stats = self._stats(c.key, c)
            if c.key in chosen:
                stats.probe_interval = self._base_interval()
                stats.next_probe = self._step + stats.probe_interval
            elif self._step >= stats.next_probe:
                plan[c.seq_id] = min(best_k or self.retry_k, c.max_k)
                stats.probe_interval = min(max(2 * stats.probe_interval, self._base_interval()),
                                           self.max_probe_interval)
                stats.next_probe = self._step + stats.probe_interval

    # ---- feedback ----------------------------------------------------------------------------

    def record_verification(self, key: Hashable, num_proposed: int, num_accepted: int) -> None:
        rejected = 1.0 if num_accepted < num_proposed else 0.0
        while key is not None:  # the key, then its group
            s = self._stats(key)
            s.accepted = s.accepted * self.decay + num_accepted
            s.trials = s.trials * self.decay + num_accepted + rejected
            key = s.group

    def record_step(self, batch_size: int, num_speculating: int, seconds: float) -> None:
        """A decode step's measured time: plain (num_speculating 0) or with speculation."""
        if not self.adaptive:
            return
        costs = self.costs(batch_size)
        a = self.cost_smoothing
        if num_speculating == 0:
            costs.plain = seconds if costs.plain is None else (1 - a) * costs.plain + a * seconds
            return
        if costs.plain is None or self._last_k == 0:
            return
        extra = max((seconds - costs.plain) / num_speculating, 1e-6)
        old = costs.extra.get(self._last_k)
        costs.extra[self._last_k] = extra if old is None else (1 - a) * old + a * extra

    def forget(self, seq_id: int) -> None:
        """Drop the statistics kept for a finished sequence (its groups' stay)."""
        for key in self._keys_of_seq.pop(seq_id, ()):
            self._acceptance.pop(key, None)
