"""What n-gram speculation would yield on live traffic, and whether it pays: the autopilot's
speculation knob.

`ShadowNgram` replays the engine's own prompt-lookup proposer (tessera.spec.ngram.lookup) on
the tokens each request really produces, whether speculation is on or off: at each point it
drafts k tokens from the context so far, counts how many of them the request's next tokens
match, and starts the next draft after the token that ended the match (the verification's own
token), exactly as a verification step would advance. So the acceptance it measures is that of
all the traffic, not only of the sequences the engine's controller chose to speculate for, and
it can be measured while speculation is off (as the prefix shadow index measures hits).

`speedup` is the decode speedup of speculating k tokens at batch B, from per-position
acceptance a (P(token i accepted | tokens before it were)), draft coverage f (the share of
verification points where a draft exists), the plain decode step time t and what one
verified draft token adds to a step, c (a draft token costs about what a prompt token in a
prefill chunk costs):

    speedup(k) = (1 + f (E(k) - 1)) t / (t + B f k c),   E(k) = 1 + a + ... + a^k
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.spec.controller import expected_tokens
from tessera.spec.ngram import _SeqIndex, lookup


@dataclass
class AcceptanceWindow:
    """Counts of the verification points replayed since the window was last taken."""

    steps: int = 0  # verification points (a decode step each, speculating or not)
    drafted: int = 0  # of those, points where the proposer had a draft
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0  # drafts that ended in a rejected token (the others were accepted whole)
    tokens: int = 0  # output tokens replayed

    @property
    def acceptance(self) -> float:
        """Per-position acceptance: accepted / (accepted + rejections), the controller's estimator."""
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else 0.0

    @property
    def coverage(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (what EngineStats.spec_acceptance_rate reports)."""
        return self.accepted / self.proposed if self.proposed else 0.0


class _Replay:
    __slots__ = ("tokens", "index", "draft", "matched")

    def __init__(self, prompt: list[int]) -> None:
        self.tokens = list(prompt)
        self.index = _SeqIndex(3)
        self.draft: list[int] = []
        self.matched = 0


class ShadowNgram:
    """Per-request replays of the n-gram proposer (max_n 3, min_n 1: the engine's) with k drafts."""

    def __init__(self, k: int, max_n: int = 3, min_n: int = 1) -> None:
        self.k, self.max_n, self.min_n = k, max_n, min_n
        self.window = AcceptanceWindow()
        self._live: dict[str, _Replay] = {}

    def start(self, request_id: str, prompt: list[int]) -> None:
        r = self._live[request_id] = _Replay(prompt)
        r.draft = self._propose(r)

    def _propose(self, r: _Replay) -> list[int]:
        return lookup(r.tokens, self.k, self.max_n, self.min_n, r.index)[0]

    def extend(self, request_id: str, tokens: list[int]) -> None:
        r = self._live.get(request_id)
        if r is None:
            return
        w = self.window
        for tok in tokens:
            w.tokens += 1
            r.tokens.append(tok)
            if r.matched < len(r.draft) and tok == r.draft[r.matched]:
                r.matched += 1  # accepted: the same verification goes on
                continue
            # This token ends the verification: the correction of a rejected draft token, the
            # bonus token after a wholly accepted draft, or a plain decode where none was drafted.
            self._close(r, rejected=r.matched < len(r.draft))
            r.draft, r.matched = self._propose(r), 0

    def _close(self, r: _Replay, rejected: bool) -> None:
        w = self.window
        w.steps += 1
        w.drafted += bool(r.draft)
        w.proposed += len(r.draft)
        w.accepted += r.matched
        w.rejections += rejected

    def finish(self, request_id: str) -> None:
        """The request ended: a draft it was matching counts with what it had matched."""
        r = self._live.pop(request_id, None)
        if r is not None and r.matched:
            self._close(r, rejected=False)

    def take(self) -> AcceptanceWindow:
        w, self.window = self.window, AcceptanceWindow()
        return w


def speedup(acceptance: float, coverage: float, k: int, batch: float, plain_step_s: float,
            per_draft_token_s: float) -> float:
    """Decode tokens per second with k-token speculation over those without (see the module doc)."""
    if k <= 0:
        return 1.0
    gain = 1.0 + coverage * (expected_tokens(acceptance, k) - 1.0)
    return gain * plain_step_s / (plain_step_s + batch * coverage * k * per_draft_token_s)


def best_k(acceptance: float, coverage: float, max_k: int, batch: float, plain_step_s: float,
           per_draft_token_s: float) -> tuple[int, float]:
    """The k in 1..max_k with the highest modelled speedup, and that speedup."""
    scores = {k: speedup(acceptance, coverage, k, batch, plain_step_s, per_draft_token_s) for k in range(1, max_k + 1)}
    k = max(scores, key=lambda j: (scores[j], -j))
    return k, scores[k]
