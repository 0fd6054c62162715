"""Prompt-lookup proposals: guess the next tokens by finding the text's current ending earlier on.

For a sequence whose tokens end in the n-gram g (n from max_n down to min_n), take the most
recent earlier place where g occurred and propose the tokens that followed it there. When that
occurrence is so recent that its continuation runs into the end of the text, the continuation
is extended periodically (the text is assumed to keep repeating with that period), so a
sequence stuck in a loop gets full-length proposals.

Each sequence keeps an index per n: n-gram -> end of its most recent occurrence, updated
incrementally as tokens arrive (amortised O(max_n) dict operations per token, no scan of the
text per step). Tokens only ever get appended (preemption recomputes the same tokens), so the
index never needs rebuilding.
"""

from __future__ import annotations

from tessera.engine.request import Sequence


class _SeqIndex:
    __slots__ = ("ends", "num_indexed")

    def __init__(self, max_n: int) -> None:
        # ends[n][gram] = e: tokens[e - n:e] == gram, the most recent such e indexed so far.
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.num_indexed = 0  # every n-gram ending at e <= num_indexed is in the index


class NgramProposer:
    """Proposes up to k tokens per sequence from its own prompt and output (no model)."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._index: dict[int, _SeqIndex] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens to follow seq's tokens; [] when no n-gram of its ending recurs."""
        return self.propose_with_match(seq, k)[0]

    def propose_with_match(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """The proposal and the length of the match it comes from (see match_length)."""
        if k <= 0:
            return [], 0
        return lookup(seq.token_ids, k, self.max_n, self.min_n,
                      self._index.setdefault(seq.seq_id, _SeqIndex(self.max_n)))

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


# How far back a match is measured: long enough to tell "copying a passage" from "a phrase recurs".
MAX_MATCH_LENGTH = 32


def propose_from_tokens(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1,
                        index: _SeqIndex | None = None) -> list[int]:
    """The continuation of the longest, then most recent, earlier occurrence of tokens' ending."""
    return lookup(tokens, k, max_n, min_n, index)[0]


def lookup(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1,
           index: _SeqIndex | None = None) -> tuple[list[int], int]:
    """(proposal, match length): propose_from_tokens, and how many tokens before the end agree
    with the tokens before the matched occurrence (n, extended back up to MAX_MATCH_LENGTH).
    A long match means the text is copying a passage, the best predictor of acceptance.

    `index` carries the n-gram index between calls on a growing token list; None builds one.
    """
    index = index or _SeqIndex(max_n)
    length = len(tokens)
    # Index the n-grams ending at first..length-1, not the current end itself (it would match
    # itself). dict.update keeps the last of repeated keys, i.e. the most recent occurrence.
    first = index.num_indexed + 1
    if first < length:
        for n in range(1, max_n + 1):
            start = max(first, n)
            if start < length:
                # n slices of length - start tokens each: the n-grams ending at start..length-1.
                grams = zip(*(tokens[start - n + i : length - n + i] for i in range(n)), strict=True)
                index.ends[n].update(zip(grams, range(start, length), strict=True))
        index.num_indexed = length - 1
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        end = index.ends[n].get(tuple(tokens[length - n :]))
        if end is None:
            continue
        # tokens[end:] follows the match; past the current end the text repeats with period
        # length - end, so proposal j is tokens[end + j] read from the extended text.
        period = length - end
        match = n
        while match < MAX_MATCH_LENGTH and match < end and tokens[end - match - 1] == tokens[length - match - 1]:
            match += 1
        return [tokens[end + j % period] for j in range(k)], match
    return [], 0
