"""Which worker gets a request: by prefix first, by load when the prefix's owner is busy.

The router keeps, per worker, an approximate index of the prompt blocks it sent there (the same
chained SHA-256 block hashes as the engines' prefix caches, an LRU capped at the worker's block
count), so it knows without asking which worker most likely caches the longest part of a prompt.
A request goes to that worker unless its load exceeds the least-loaded candidate's by more than
`load_slack`; then, and when no worker matches, to the least-loaded one. Load is what the router
itself has in flight on the worker (exact, no polling lag) plus a penalty once its KV pool is
nearly full.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tessera.engine.kv_cache import hash_block


def prompt_block_hashes(prompt_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks (what a prefix cache can hold of it)."""
    hashes: list[bytes] = []
    for i in range(len(prompt_ids) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, prompt_ids[i * block_size : (i + 1) * block_size]))
    return hashes


@dataclass
class WorkerLoadView:
    """What the router knows of a worker's load."""

    num_requests: int = 0  # in flight on it, by the router's own count
    num_prompt_tokens: int = 0  # of those, prompt tokens not yet prefilled (prefill workers)
    kv_cache_usage: float = 0.0  # from its last poll

    def score(self, by_tokens: bool) -> float:
        base = self.num_prompt_tokens / 512 if by_tokens else self.num_requests
        return base + (8.0 if self.kv_cache_usage > 0.95 else 0.0)


@dataclass
class PrefixIndex:
    capacity_blocks: int
    blocks: OrderedDict = field(default_factory=OrderedDict)

    def match(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)


class PrefixAwarePolicy:
    def __init__(self, load_slack: float = 4.0, prefix_aware: bool = True) -> None:
        self.load_slack = load_slack
        self.prefix_aware = prefix_aware

    def choose(self, candidates: list[str], loads: dict[str, WorkerLoadView], indexes: dict[str, PrefixIndex],
               hashes: list[bytes], by_tokens: bool = False) -> tuple[str, int]:
        """(worker, blocks of the prompt it is believed to cache). Ties go to the first candidate."""
        least = min(candidates, key=lambda w: loads[w].score(by_tokens))
        if not self.prefix_aware or not hashes:
            return least, 0
        matches = {w: indexes[w].match(hashes) for w in candidates}
        best = max(candidates, key=lambda w: (matches[w], -loads[w].score(by_tokens)))
        if matches[best] == 0:
            return least, 0
        if loads[best].score(by_tokens) - loads[least].score(by_tokens) > self.load_slack:
            return least, matches[least]
        return best, matches[best]
