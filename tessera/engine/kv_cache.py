"""The KV cache block pool: which physical blocks each sequence holds, and the prefix cache.

Pure Python bookkeeping. The K/V tensors live in the model runner, which only reads
`seq.block_table` (position p of a sequence lives in block `block_table[p // block_size]`).
Block 0 is the padding block and is never handed out; usable blocks are 1 .. num_blocks-1.

Automatic prefix caching: every full block whose K/V have been computed (prompt or generated
tokens alike) is registered under a chained hash, SHA-256(parent block's hash || the block's
token ids), so one hash names the whole prefix up to the end of that block. A new sequence
takes the longest run of registered blocks matching its leading tokens instead of computing
them again. SHA-256 puts an accidental collision (two prefixes sharing a hash, which would
silently serve another prompt's K/V) out of reach, so lookups compare hashes only.

Freed blocks keep their hash and contents: they wait in the free list, an LRU, and a later
sequence with the same prefix revives them. A cached block loses its hash (is evicted) only
when it is taken for new content, least recently freed first.

With a host tier attached (`attach_host_tier`, --swap-space), an evicted cached block is
demoted rather than forgotten: its K/V are copied to a host block and its hash kept in the
host index (tessera.engine.swap.HostBlockPool). A prefix lookup that runs past the device index
continues into the host index; host-resident blocks of a hit are promoted: they get fresh
device blocks and are copied back before the step's forward pass. The copies are collected here
and handed to the scheduler by `take_block_copies`, so they run batched with the swap copies.

Sliding-window models (every layer windowed, e.g. Mistral): `release_before` frees the blocks
that fell out of the window; their table entries become 0, the padding block, so positions still
index the table and attention masks them (tessera.attention.backend's sliding_window).

No copy-on-write is needed: only full blocks whose K/V are already computed are ever shared,
and a sequence writes K/V only at positions >= its num_computed_tokens, which lie past the end
of every block it shares (admission never lets a hit cover the last token). So nobody ever
writes into a block somebody else holds.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.engine.request import Sequence

if TYPE_CHECKING:
    from tessera.engine.swap import HostBlockPool


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """SHA-256 of the parent block's hash and this block's token ids (as little-endian int64).

    The encoding is unambiguous: the parent part is 0 or 32 bytes and a block has a fixed
    number of tokens, so distinct (parent, tokens) pairs never encode to the same bytes.
    """
    tokens = array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()  # same hash on every host, so hashes could travel with KV transfers
    return hashlib.sha256((parent_hash or b"") + tokens.tobytes()).digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block is registered in the prefix cache


class KVCacheManager:
    """Hands out KV blocks to sequences; shares and revives computed full blocks by prefix hash.

    Contract with the scheduler: a waiting sequence enters through `allocate_for_admission`
    (cached prefix + blocks of its first chunk); a running one grows with `allocate_slots`
    before each step; after a step advanced `num_computed_tokens`, `commit_computed` registers
    the blocks that became full; `free` returns everything (finish, abort or preemption).
    Every call that can fail is all-or-nothing: on False nothing was taken.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks (block 0 is padding), got {num_blocks}; "
                f"raise --kv-cache-memory"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, next to be taken first. Blocks without a hash sit at the front (their
        # contents are worthless); cached ones follow in the order they were freed (LRU).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> id of the block holding that prefix
        # seq_id -> chained hashes of the sequence's leading full computed blocks, so each
        # block is hashed once and the next block's parent hash is at hand.
        self._seq_hashes: dict[int, list[bytes]] = {}
        # seq_id -> leading table entries already freed by release_before (now 0).
        self._num_released: dict[int, int] = {}
        # Metrics: prefix-cache queries and hits in tokens (at admission), cached blocks evicted.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_evictions = 0
        # The host tier (None without one) and the block copies owed to it before the next
        # forward pass: demotions (device block, host block), promotions (host block, device block).
        self.host: HostBlockPool | None = None
        self._demotions: list[tuple[int, int]] = []
        self._promotions: list[tuple[int, int]] = []

    def attach_host_tier(self, host: HostBlockPool) -> None:
        """Demote evicted cached blocks to `host` and promote host-resident prefix hits."""
        self.host = host

    def take_block_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The demotion and promotion copies owed since the last call; they must run before
        the next forward pass writes any device block."""
        copies = self._demotions, self._promotions
        self._demotions, self._promotions = [], []
        return copies

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones (revivable) included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation -------------------------------------------------------------------------

    def allocate_for_admission(self, seq: Sequence, max_new_tokens: int, num_restored_tokens: int = 0) -> bool:
        """Admit a sequence that holds no blocks: take its cached prefix and its first chunk.

        The prefix hit is the longest run of cached full blocks matching `seq.token_ids`
        (prompt, plus outputs when recomputing after a preemption), capped below num_tokens so
        at least one token is computed to produce logits. Sets num_computed_tokens and
        num_cached_tokens to the hit length and grows the table to cover the first chunk,
        min(uncomputed, max_new_tokens) tokens. Returns False, taking nothing and leaving the
        sequence as it was, when the pool cannot hold that much.

        num_restored_tokens: a sequence coming back from the host pool has the K/V of that many
        leading tokens saved there. Fresh blocks cover the ones past the prefix hit (the caller
        copies them in before the step runs) and num_computed_tokens counts them.
        """
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        assert num_restored_tokens < seq.num_tokens, "at least one token must be left to compute"
        hit_hashes = self._find_cached_prefix(seq) if self.enable_prefix_caching else []
        # Device block of each hit, None where the hit is host-resident (promoted below).
        hit_ids = [self._cached.get(h) for h in hit_hashes]
        num_hit_tokens = len(hit_hashes) * self.block_size
        num_computed = max(num_hit_tokens, num_restored_tokens)
        num_new_tokens = min(seq.num_tokens - num_computed, max_new_tokens)
        num_fresh = self.num_blocks_for(num_computed + num_new_tokens) - len(hit_hashes)
        num_promoted = hit_ids.count(None)
        num_revived = sum(1 for bid in hit_ids if bid is not None and self.blocks[bid].ref_count == 0)
        if num_fresh + num_promoted + num_revived > len(self._free):
            return False
        for bid in hit_ids:  # first, so that taking blocks for promotions cannot evict them
            if bid is not None:
                self._acquire(self.blocks[bid])
        if num_promoted:
            # Out of the host index before any demotion below could drop them to make room.
            sources = {h: self.host.promote(h) for h, bid in zip(hit_hashes, hit_ids, strict=True) if bid is None}
            for i, h in enumerate(hit_hashes):
                if hit_ids[i] is None:
                    block = self.blocks[self._take_free_block()]
                    block.block_hash = h
                    self._cached[h] = hit_ids[i] = block.block_id
                    self._promotions.append((sources[h], block.block_id))
        seq.block_table = list(hit_ids)
        seq.num_computed_tokens = seq.num_cached_tokens = num_hit_tokens
        self.allocate_slots(seq, num_computed - num_hit_tokens + num_new_tokens)  # cannot fail: checked above
        seq.num_computed_tokens = num_computed
        if self.enable_prefix_caching:
            self._seq_hashes[seq.seq_id] = hit_hashes
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_hit_tokens
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to cover num_computed_tokens + num_new_tokens tokens.

        Returns False, taking nothing, when the free list is too short.
        """
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed since the last call.

        Call after every step that advanced seq.num_computed_tokens. When another block
        already holds the same prefix (two sequences computed it at once), the first stays
        registered and this one stays anonymous, so it is recycled first once freed.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return  # the common decode step: no block filled up
        tokens, bs = seq.token_ids, self.block_size
        for i in range(len(hashes), num_full):
            block_hash = hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs])
            hashes.append(block_hash)
            if block_hash not in self._cached:
                block = self.blocks[seq.block_table[i]]
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks; those no one else holds go to the free list.

        Tail first, so that among a sequence's cached blocks the head of its prefix, the part
        other requests are most likely to share, is evicted last.
        """
        self._release(b for b in reversed(seq.block_table) if b != 0)  # 0: released by release_before
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)
        self._num_released.pop(seq.seq_id, None)

    def release_before(self, seq: Sequence, position: int) -> int:
        """Free seq's blocks that hold only positions before `position` (sliding-window
        attention: no layer reads them again); their table entries become 0. Returns how many
        blocks were freed. Oldest first, so they are evicted before the rest of the prefix."""
        end = min(max(position, 0) // self.block_size, len(seq.block_table))
        start = self._num_released.get(seq.seq_id, 0)
        if end <= start:
            return 0
        table = seq.block_table
        self._release(b for b in table[start:end] if b != 0)
        table[start:end] = [0] * (end - start)
        self._num_released[seq.seq_id] = end
        return end - start

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks covering seq's first num_tokens positions; free the rest.

        Speculative decoding's rollback: blocks taken for proposals the target rejected go back
        to the free list. They hold no computed prefix (num_tokens >= num_computed_tokens), so
        they carry no hash and nobody else holds them.
        """
        assert num_tokens >= seq.num_computed_tokens, "trim would drop computed K/V"
        keep = self.num_blocks_for(num_tokens)
        self._release(reversed(seq.block_table[keep:]))
        del seq.block_table[keep:]

    # ---- internals --------------------------------------------------------------------------

    def _release(self, block_ids) -> None:
        """Drop one reference to each block; a block nobody holds joins the free list, at the
        evict-first end unless it carries a hash (cached contents stay for LRU eviction)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def _find_cached_prefix(self, seq: Sequence) -> list[bytes]:
        """Hashes of the longest run of cached blocks (on the device or in the host tier)
        matching seq's leading tokens, leaving at least one token uncovered (a fully cached
        prompt backs off one block)."""
        tokens, bs = seq.token_ids, self.block_size
        hashes: list[bytes] = []
        host = self.host
        for i in range((len(tokens) - 1) // bs):
            block_hash = hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs])
            if block_hash not in self._cached and (host is None or not host.has_cached(block_hash)):
                break
            hashes.append(block_hash)
        return hashes

    def _acquire(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]  # revive a cached free block
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its contents are about to be overwritten
            del self._cached[block.block_hash]
            if self.host is not None:  # keep them in the host tier if it has room
                copy = self.host.demote(block.block_hash, block_id)
                if copy is not None:
                    self._demotions.append(copy)
            block.block_hash = None
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    # ---- integrity --------------------------------------------------------------------------

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless the pool is consistent with `seqs`, all live sequences.

        free + in use == usable; each block's ref_count == the number of block tables holding
        it; free blocks have ref_count 0; every cache entry points at a block with that hash
        and every hashed block is the entry for its hash; block 0 is never handed out.
        """
        holders: Counter[int] = Counter()
        for seq in seqs:
            released = self._num_released.get(seq.seq_id, 0)
            _require(all(b == 0 for b in seq.block_table[:released]), f"seq {seq.seq_id}: a released entry is not 0")
            table = seq.block_table[released:]  # entries before are 0: released out of the window
            _require(len(set(table)) == len(table), f"seq {seq.seq_id} holds a block twice: {table}")
            _require(
                seq.num_computed_tokens <= len(seq.block_table) * self.block_size,
                f"seq {seq.seq_id}: {seq.num_computed_tokens} computed tokens but {len(seq.block_table)} blocks",
            )
            holders.update(table)
        pad = self.blocks[0]
        _require(0 not in holders and 0 not in self._free and pad.ref_count == 0 and pad.block_hash is None,
                 "the padding block 0 was handed out")
        in_use = 0
        for block in self.blocks[1:]:
            bid = block.block_id
            _require(block.ref_count == holders[bid],
                     f"block {bid}: ref_count {block.ref_count} but {holders[bid]} tables hold it")
            _require((bid in self._free) == (block.ref_count == 0),
                     f"block {bid}: ref_count {block.ref_count}, in free list: {bid in self._free}")
            if block.block_hash is not None:
                _require(self._cached.get(block.block_hash) == bid, f"block {bid}: hash not registered to it")
            in_use += block.ref_count > 0
        _require(len(self._free) + in_use == self.num_usable_blocks,
                 f"free {len(self._free)} + in use {in_use} != usable {self.num_usable_blocks}")
        for block_hash, bid in self._cached.items():
            _require(self.blocks[bid].block_hash == block_hash, f"cache entry points at block {bid} of another hash")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"KV cache invariant broken: {message}")
