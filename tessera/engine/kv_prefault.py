"""Fault a server's KV pool in ahead of use, on a thread that runs only when a core is idle.

The pool is fresh anonymous memory (tessera.memory): nothing is resident until a step writes a
block, and the block pool hands out never-used blocks first (in ascending order), so every
request's new blocks cost page faults inside the step, ~90 of them a block for the default model
(30 layers, K and V). In this VM a fault costs ~2 us, and far more when the host has to back the
page anew: a rate-inf `vllm bench serve` run that followed other processes' runs went 69-82% of
the offline engine's speed with the kernel zeroing pages under the KV write, against 88-96% with
the pool faulted in beforehand (Intel Xeon model 167, docs/compare.md "Session 26"). vLLM zeroes
its whole KV cache while it loads.

`KVPrefaulter` walks the pool in the order blocks are handed out, a run of blocks at a time across
every layer's tensors, with `madvise(MADV_POPULATE_WRITE)`: the pages become resident and writable
without their contents being touched, so it is safe beside the engine thread writing the same
blocks. The thread runs under SCHED_IDLE: it takes a core only when nothing else wants one (before
traffic arrives, between bursts) and never slows a step. The server starts one after its warm-up
(`--no-kv-prefault` keeps the pool lazy: resident only as far as it has been used).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
import time

import torch

logger = logging.getLogger("tessera")

MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = 4096
BLOCKS_PER_CALL = 64  # a run of blocks per madvise call and tensor (~0.4 MB for the default model)


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    madvise = getattr(libc, "madvise", None)
    if madvise is None:
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def populate(addr: int, length: int) -> bool:
    """MADV_POPULATE_WRITE over the pages covering [addr, addr + length); False where the kernel or
    platform does not have it."""
    madvise = _madvise()
    if madvise is None or length <= 0:
        return False
    start = addr & ~(_PAGE - 1)
    end = (addr + length + _PAGE - 1) & ~(_PAGE - 1)
    return madvise(start, end - start, MADV_POPULATE_WRITE) == 0


class KVPrefaulter:
    """Populates `caches` (per layer a tuple of tensors whose first dimension is num_blocks *
    block_size slots, as allocate_kv_cache makes them) block run by block run, lowest block ids
    first, on a daemon thread at idle priority. `start()` returns at once."""

    def __init__(self, caches: list[tuple[torch.Tensor, ...]], block_size: int) -> None:
        self.tensors = [t for layer in caches for t in layer if t.device.type == "cpu" and t.numel()]
        self.num_blocks = self.tensors[0].shape[0] // block_size if self.tensors else 0
        self.done_blocks = 0  # blocks populated in every tensor so far
        self._thread: threading.Thread | None = None

    def start(self) -> KVPrefaulter:
        if self.tensors and self.num_blocks > 0:
            self._thread = threading.Thread(target=self._run, name="tessera-kv-prefault", daemon=True)
            self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        except (AttributeError, OSError):
            pass  # then it competes as a normal thread; the work is the same
        started = time.perf_counter()
        spans = [(t.data_ptr(), t.numel() * t.element_size() // self.num_blocks) for t in self.tensors]
        for first in range(0, self.num_blocks, BLOCKS_PER_CALL):
            count = min(BLOCKS_PER_CALL, self.num_blocks - first)
            for base, block_bytes in spans:
                if not populate(base + first * block_bytes, count * block_bytes):
                    logger.debug("KV prefault stopped: madvise(MADV_POPULATE_WRITE) refused (errno %d)",
                                 ctypes.get_errno())
                    return
            self.done_blocks = first + count
        logger.info("KV pool resident: %d blocks faulted in on an idle core in %.1fs", self.num_blocks,
                    time.perf_counter() - started)
