"""The host-memory KV tier: a second block pool for preempted sequences' K/V and for cached
prefix blocks the device pool had to evict.

Three small parts, one job each:

- `HostBlockPool` (the scheduler's): which host blocks each swapped-out sequence holds, and the
  host side of the prefix cache (block hash -> host block, LRU). Pure Python, like
  KVCacheManager. Invariant: every host block is exactly one of held (by a swapped sequence,
  which is waiting and holds no device blocks), cached (under one hash), free, or pending (read
  by this step's copies, free from the next step on).
- `HostKVCache` (the model runner's): the host tensors, the same layout as the device pool
  (on CPU simply a second pool; next to an accelerator, pinned CPU memory), and the batched
  copies: one index_select + index_copy_ per tensor per layer for all of a step's blocks.
- `PreemptionPolicy`: recompute, swap, or auto. Auto swaps when the host pool has room and
  copying the blocks out and back costs less than recomputing the tokens the prefix cache
  would not give back. Both costs are measured once at start-up (`measure_swap_costs`): a
  round-trip copy of 1 and of k blocks, and a prefill of a short dummy prompt.

Demotion and promotion (prefix caching with a host tier): when the device pool evicts a cached
block (takes a free block that still holds a hashed prefix for new content), its K/V are copied
to a host block and its hash is kept in the host index instead of being forgotten; a host block
is taken from the free ones first, else the least recently demoted cached one is dropped. A
later request whose prefix runs into a host-resident hash gets a fresh device block that the
host block is copied back into (promotion) instead of recomputing those tokens; the hash moves
back to the device index.

Protocol, once per step: the scheduler's preemptions and the device pool's evictions fill
SchedulerOutput.swap_out with (device block, host block) pairs before the blocks are reused;
its admissions fill swap_in with (host block, device block) pairs (swapped sequences coming
back, promotions) after fresh device blocks were taken. The engine runs all swap-outs, then all
swap-ins, then the forward pass. Nothing writes a device block between schedule() and the
forward pass, so a reused block still holds its old K/V when it is copied out, and a block
demoted and promoted again in one step is copied out before it is copied back. A host block
that a swap-in reads this step is pending until the next step's `begin_step`, so no swap-out of
the same step (which runs first) can overwrite it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tessera.engine.request import Sequence, SequenceStatus

KVCache = tuple[torch.Tensor, ...]
PREEMPTION_MODES = ("recompute", "swap", "auto")


class HostBlockPool:
    """Host block ids 0 .. num_blocks-1 (no padding block: nothing reads the host pool in a
    forward pass): the host block table of every swapped-out sequence, and the host prefix
    cache of demoted blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV pool needs at least 1 block, got {num_blocks}; raise --swap-space")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes the lowest id
        self._tables: dict[int, list[int]] = {}  # seq_id -> host blocks holding its first tokens
        self._num_tokens: dict[int, int] = {}  # seq_id -> tokens whose K/V those blocks hold
        # Demoted prefix blocks: hash -> host block, least recently demoted first.
        self._cached: OrderedDict[bytes, int] = OrderedDict()
        self._pending: list[int] = []  # read by this step's swap-ins: free from the next step on
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_demoted_blocks = 0  # cached blocks copied here when the device pool evicted them
        self.num_promoted_blocks = 0  # of those, copied back for a prefix hit
        self.num_evicted_blocks = 0  # demoted blocks dropped to make room here

    @property
    def num_free_blocks(self) -> int:
        """Host blocks no swapped sequence holds (cached ones included, as on the device)."""
        return self.num_blocks - sum(len(t) for t in self._tables.values())

    @property
    def num_available_blocks(self) -> int:
        """Host blocks a swap-out or demotion can take in this step: free or cached."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_swapped_seqs(self) -> int:
        return len(self._tables)

    def begin_step(self) -> None:
        """The last step's copies ran: the host blocks its swap-ins read are free again."""
        if self._pending:
            self._free.extend(self._pending)
            self._pending.clear()

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def num_saved_tokens(self, seq: Sequence) -> int:
        return self._num_tokens[seq.seq_id]

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Take host blocks for seq's computed tokens; return (device block, host block) copies.

        Call before the device blocks are freed. The caller checked there is room
        (num_available_blocks); demoted blocks are dropped for it if need be.
        """
        n = seq.num_computed_tokens
        device_blocks = seq.block_table[: -(-n // self.block_size)]
        assert n > 0 and len(device_blocks) <= self.num_available_blocks and seq.seq_id not in self._tables
        host_blocks = [self._take() for _ in device_blocks]
        self._tables[seq.seq_id] = host_blocks
        self._num_tokens[seq.seq_id] = n
        self.num_swapped_out_blocks += len(host_blocks)
        return list(zip(device_blocks, host_blocks, strict=True))

    def swap_in(self, seq: Sequence, num_hit_blocks: int) -> list[tuple[int, int]]:
        """seq was just given device blocks covering its saved tokens, the first num_hit_blocks
        of them from the prefix cache. Release its host blocks (pending: the copies read them
        this step); return the (host block, device block) copies for the rest."""
        host_blocks = self._tables.pop(seq.seq_id)
        del self._num_tokens[seq.seq_id]
        pairs = list(zip(host_blocks[num_hit_blocks:], seq.block_table[num_hit_blocks : len(host_blocks)], strict=True))
        self._pending.extend(host_blocks)
        self.num_swapped_in_blocks += len(pairs)
        return pairs

    def release(self, seq: Sequence) -> None:
        """Drop seq's host blocks without copying (it finished or was aborted while swapped out)."""
        host_blocks = self._tables.pop(seq.seq_id, None)
        if host_blocks is not None:
            del self._num_tokens[seq.seq_id]
            self._free.extend(reversed(host_blocks))

    # ---- the host prefix cache ------------------------------------------------------------

    def has_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def cached_blocks(self) -> dict[bytes, int]:
        """hash -> host block of every demoted block here, least recently demoted first."""
        return dict(self._cached)

    def demote(self, block_hash: bytes, device_block: int) -> tuple[int, int] | None:
        """The device pool is evicting `device_block`, which holds the prefix `block_hash`:
        keep it here. Returns the (device block, host block) copy, or None when no copy is
        needed (the hash is already here; it becomes the most recent) or no host block can be
        had (all held by swapped sequences or pending)."""
        host_block = self._cached.get(block_hash)
        if host_block is not None:
            self._cached.move_to_end(block_hash)
            return None
        if not self._free and not self._cached:
            return None
        host_block = self._take()
        self._cached[block_hash] = host_block
        self.num_demoted_blocks += 1
        return device_block, host_block

    def promote(self, block_hash: bytes) -> int:
        """A prefix hit on a demoted block: forget its hash here and return the host block to
        copy back. The block is pending until the copy has run."""
        host_block = self._cached.pop(block_hash)
        self._pending.append(host_block)
        self.num_promoted_blocks += 1
        return host_block

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        _, host_block = self._cached.popitem(last=False)  # drop the least recently demoted block
        self.num_evicted_blocks += 1
        return host_block

    # ---- integrity ------------------------------------------------------------------------

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless every host block is exactly one of held by a swapped
        sequence (`seqs`: all live sequences; each swapped one waits with no device blocks),
        cached under one hash, free, or pending."""
        live = {seq.seq_id: seq for seq in seqs}
        held: list[int] = []
        for seq_id, table in self._tables.items():
            seq = live.get(seq_id)
            _require(seq is not None, f"host blocks {table} held by seq {seq_id}, which is not live")
            _require(seq.status is SequenceStatus.WAITING and not seq.block_table and seq.num_computed_tokens == 0,
                     f"swapped seq {seq_id} is {seq.status.value} with {len(seq.block_table)} device blocks")
            n = self._num_tokens[seq_id]
            _require(0 < n < seq.num_tokens and len(table) == -(-n // self.block_size),
                     f"swapped seq {seq_id}: {len(table)} host blocks for {n} saved tokens")
            held.extend(table)
        groups = {"held": held, "cached": list(self._cached.values()), "free": self._free, "pending": self._pending}
        everything = [b for blocks in groups.values() for b in blocks]
        _require(len(set(everything)) == len(everything),
                 "a host block is in two places: " + ", ".join(f"{k} {sorted(v)}" for k, v in groups.items()))
        _require(len(everything) == self.num_blocks,
                 f"host: held {len(held)} + cached {len(self._cached)} + free {len(self._free)} + pending "
                 f"{len(self._pending)} != total {self.num_blocks}")
        _require(all(0 <= b < self.num_blocks for b in everything), "a host block id is out of range")
        _require(self.num_promoted_blocks + len(self._cached) + self.num_evicted_blocks == self.num_demoted_blocks,
                 "every demoted block is cached, promoted or evicted")


class HostKVCache:
    """The host copy of the KV pool's layout: per layer, tensors of [num_blocks * block_size, ...]."""

    def __init__(self, device_caches: list[KVCache], num_blocks: int, block_size: int) -> None:
        device = device_caches[0][0].device
        pin = device.type == "cuda"  # page-locked, so the accelerator can DMA it
        self.block_size = block_size
        self.caches = [
            tuple(torch.zeros((num_blocks * block_size, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in layer)
            for layer in device_caches
        ]

    def swap_out(self, device_caches: list[KVCache], pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device block, host block)."""
        if pairs:
            self._copy(device_caches, self.caches, [p[0] for p in pairs], [p[1] for p in pairs])

    def swap_in(self, device_caches: list[KVCache], pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: pairs of (host block, device block)."""
        if pairs:
            self._copy(self.caches, device_caches, [p[0] for p in pairs], [p[1] for p in pairs])

    def _copy(self, src_caches: list[KVCache], dst_caches: list[KVCache], src_blocks: list[int],
              dst_blocks: list[int]) -> None:
        bs = self.block_size
        src_dev, dst_dev = src_caches[0][0].device, dst_caches[0][0].device
        src_ids = torch.tensor(src_blocks, dtype=torch.long, device=src_dev)
        dst_ids = torch.tensor(dst_blocks, dtype=torch.long, device=dst_dev)
        for src_layer, dst_layer in zip(src_caches, dst_caches, strict=True):
            for src, dst in zip(src_layer, dst_layer, strict=True):
                src, dst = _raw(src), _raw(dst)
                blocks = src.view(-1, bs, *src.shape[1:]).index_select(0, src_ids)
                dst.view(-1, bs, *dst.shape[1:]).index_copy_(0, dst_ids, blocks.to(dst_dev))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 cache's bytes as uint8 (--kv-cache-dtype fp8): CPU index_copy_ has no float8 kernel,
    and a block copy moves bytes anyway."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


@dataclass(frozen=True)
class SwapCosts:
    """Measured once at start-up: seconds for a round trip (out and back) of n blocks is
    roundtrip_overhead_s + n * roundtrip_per_block_s; recompute is prefill_per_token_s a token."""

    roundtrip_overhead_s: float
    roundtrip_per_block_s: float
    prefill_per_token_s: float

    def swap_pays(self, num_blocks: int, num_recompute_tokens: int) -> bool:
        copy = self.roundtrip_overhead_s + num_blocks * self.roundtrip_per_block_s
        return copy < num_recompute_tokens * self.prefill_per_token_s


class PreemptionPolicy:
    """Decides, for a sequence about to be preempted, whether its blocks go to the host pool.

    recompute: never. swap: whenever the host pool has room (else recompute). auto: when the
    host pool has room and SwapCosts says the copy is cheaper than recomputing the tokens whose
    blocks nobody else holds (blocks shared with a running sequence stay cached on the device
    and would come back from the prefix cache for free).
    """

    def __init__(self, mode: str, costs: SwapCosts | None = None) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"--preemption-mode {mode!r}: choose one of {', '.join(PREEMPTION_MODES)}")
        if mode == "auto" and costs is None:
            raise ValueError("auto preemption needs measured SwapCosts")
        self.mode = mode
        self.costs = costs

    def should_swap(self, seq: Sequence, host: HostBlockPool | None, num_shared_prefix_tokens: int) -> bool:
        if self.mode == "recompute" or host is None or seq.num_computed_tokens == 0:
            return False
        num_blocks = -(-seq.num_computed_tokens // host.block_size)
        if num_blocks > host.num_available_blocks:
            return False
        if self.mode == "swap":
            return True
        return self.costs.swap_pays(num_blocks, seq.num_computed_tokens - num_shared_prefix_tokens)


def num_host_kv_blocks(swap_space_gib: float, block_size: int, kv_bytes_per_token: int) -> int:
    """Blocks of the host pool that --swap-space GiB holds (0 when it is 0)."""
    if swap_space_gib == 0:
        return 0
    block_bytes = block_size * kv_bytes_per_token
    num_blocks = int(swap_space_gib * (1 << 30)) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"--swap-space {swap_space_gib} GiB holds no KV block ({block_bytes} bytes per block of "
            f"{block_size} tokens); raise --swap-space, or give 0 for no host KV tier"
        )
    return num_blocks


def measure_swap_costs(runner, num_usable_blocks: int, num_host_blocks: int) -> SwapCosts:
    """Time a round-trip copy of 1 and of k blocks, and a prefill of a short dummy prompt.

    Runs at start-up, before any request: the device blocks it writes (1 .. k) are free and
    anonymous, so their contents do not matter. Each figure is the best of a few runs.
    """
    from tessera.sampling import SamplingParams

    bs = runner.block_size
    host = runner.host_kv
    k = max(2, min(16, num_usable_blocks, num_host_blocks))

    def roundtrip(n: int) -> float:
        pairs = [(1 + i % num_usable_blocks, i % num_host_blocks) for i in range(n)]
        t0 = time.perf_counter()
        host.swap_out(runner.kv_caches, pairs)
        host.swap_in(runner.kv_caches, [(h, d) for d, h in pairs])
        return time.perf_counter() - t0

    t1 = min(roundtrip(1) for _ in range(3))
    tk = min(roundtrip(k) for _ in range(3))
    per_block = max(tk - t1, 0.0) / (k - 1)
    overhead = max(t1 - per_block, 0.0)

    num_tokens = min(64, num_usable_blocks * bs)
    seq = Sequence("tessera-warmup", [0] * num_tokens, SamplingParams(max_tokens=1))
    seq.block_table = list(range(1, 1 + -(-num_tokens // bs)))
    times = []
    for _ in range(2):  # the first run also warms up
        t0 = time.perf_counter()
        runner.execute(runner.prepare([(seq, num_tokens)], 0))
        times.append(time.perf_counter() - t0)
    return SwapCosts(overhead, per_block, min(times) / num_tokens)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"host KV pool invariant broken: {message}")
