"""Large, long-lived CPU buffers (the packed weights, the KV cache): fresh anonymous memory.

A buffer from here is an anonymous `mmap`: the kernel hands out zero pages on first touch, so
nothing is written at start-up (the 186k-token KV pool of the default engine, 4.3 GB, was a 1.3 s
memset and 4.3 GB of resident memory before the first request) and a pool is resident only as far
as it has been used.

`huge=True` also asks for transparent huge pages. A decode step streams every weight from DRAM;
on 4 KiB pages that walk misses the TLB about every page and the hardware prefetchers stop at
each page edge. Where Linux leaves huge pages to `madvise` (`/sys/kernel/mm/transparent_hugepage/
enabled` = madvise, a common default), memory gets 2 MiB pages only if it asks before its first
touch. Measured (Intel Xeon model 207): prefill 256 124 -> 109 ms with the packed weights on huge
pages, decode unchanged within noise. The KV cache does not ask: faulting 4.3 GB of huge pages
took 6.8 s (the kernel compacts memory for each one when `defrag` is madvise), a cost the first
requests would pay at run time instead, for no gain measured in a whole decode step.

torch's own `THP_MEM_ALLOC_ENABLE=1` asks for every allocation of 2 MiB or more, short-lived ones
too (a step's logits), whose faults cost more than they save (a 6 MiB copy went from ~0.3 to
8 ms), so it is not used.
"""

from __future__ import annotations

import mmap
import sys

import torch

_HUGE = 2 << 20
MIN_BYTES = 4 << 20  # smaller buffers come from torch's allocator


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


def _advise(mm: mmap.mmap, start: int, length: int) -> None:
    """MADV_HUGEPAGE on [start, start + length) of mm (a refusal only costs speed)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and length > 0:
        try:
            mm.madvise(advice, start, length)
        except OSError:
            pass


def _fresh(nbytes: int, huge: bool) -> torch.Tensor | None:
    """nbytes of zero, untouched uint8 memory from an anonymous mapping (None off Linux); with
    huge, 2 MiB-aligned and advised for huge pages."""
    if not sys.platform.startswith("linux"):
        return None
    pad = _HUGE if huge else 0
    mm = mmap.mmap(-1, nbytes + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # shares the mapping and keeps it alive
    start = -raw.data_ptr() % _HUGE if huge else 0
    if huge:
        _advise(mm, start, (nbytes // _HUGE) * _HUGE)
    return raw[start : start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
          huge: bool = False) -> torch.Tensor:
    """torch.zeros(shape, dtype); a large CPU buffer comes from fresh anonymous memory (see above)."""
    device = torch.device(device)
    nbytes = _nbytes(shape, dtype)
    raw = _fresh(nbytes, huge) if device.type == "cpu" and nbytes >= MIN_BYTES else None
    if raw is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return raw.view(dtype).view(shape)


class Arena:
    """One fresh buffer carved into zero-filled tensors, in the order their sizes were given:
    buffers too small for a huge page of their own (a layer's weights) still get them together,
    and a pool of many tensors is one mapping. Pages become resident only as they are written, so
    packing weights into it one by one (freeing each original) never holds two copies of the model."""

    ALIGN = 64  # each tensor starts on a cache line

    def __init__(self, sizes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device | str = "cpu",
                 huge: bool = False) -> None:
        total = sum(-(-_nbytes(shape, dtype) // self.ALIGN) * self.ALIGN for shape, dtype in sizes)
        self._buffer = zeros((max(total, 1),), torch.uint8, device, huge)
        self._at = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next tensor of this shape and dtype: zeros, never handed out before."""
        nbytes = _nbytes(shape, dtype)
        if self._at + nbytes > self._buffer.numel():
            raise ValueError(f"arena exhausted: {nbytes} bytes asked, {self._buffer.numel() - self._at} left")
        out = self._buffer[self._at : self._at + nbytes].view(dtype).view(shape)
        self._at += -(-nbytes // self.ALIGN) * self.ALIGN
        return out


def copies_in_order(tensors: list[torch.Tensor], device: torch.device | str = "cpu",
                    huge: bool = False) -> list[torch.Tensor]:
    """Copies of `tensors` carved from one Arena in their order: weights a decode step streams
    (the bf16 engine's GGUF blocks, quantized layers' buffers) as one mapping and one stream for
    the prefetchers and the TLB."""
    arena = Arena([(tuple(t.shape), t.dtype) for t in tensors], device, huge)
    return [arena.take(tuple(t.shape), t.dtype).copy_(t) for t in tensors]
