"""Large, long-lived CPU buffers (the KV cache, packed weights) on transparent huge pages.

A decode step streams the whole KV cache of its sequences and every weight from DRAM. On 4 KiB
pages that walk misses the TLB about every page, and the hardware prefetchers stop at each page
edge; the KV cache is also read in random blocks. Where Linux leaves huge pages to `madvise`
(`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, a common default), a buffer is only
backed by 2 MiB pages if it asks before its first touch. `zeros` allocates untouched memory,
advises the 2 MiB-aligned part of it, then fills it. Measured on the paged attention kernel
(Intel Xeon model 207, 30 layers' KV in turn): 0.81 -> 0.73 ms per layer call.

torch's own `THP_MEM_ALLOC_ENABLE=1` does this for every allocation of 2 MiB or more; that also
covers short-lived ones (a step's logits), whose huge-page faults and compaction cost more than
they save (a 6 MiB logits copy went from ~0.3 to 8 ms), so it is not used.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
MIN_BYTES = 4 << 20  # smaller buffers are not worth a huge page


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _advised_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """nbytes of untouched uint8 memory, its 2 MiB-aligned part advised for huge pages (a plain
    torch.empty where that does not apply)."""
    madvise = _madvise() if device.type == "cpu" and nbytes >= MIN_BYTES else None
    if madvise is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)  # not yet touched: no page is backed
    start = -raw.data_ptr() % _HUGE
    madvise(raw.data_ptr() + start, (nbytes // _HUGE) * _HUGE, _MADV_HUGEPAGE)  # a refusal only costs speed
    return raw[start : start + nbytes]  # a view: it keeps `raw` alive


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype), on huge pages where it is a large CPU buffer and Linux allows it."""
    device = torch.device(device)
    return _advised_empty(_nbytes(shape, dtype), device).view(dtype).view(shape).zero_()


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


class Arena:
    """One huge-page buffer carved into zero-filled tensors: buffers too small for a huge page of
    their own (a layer's weights, a small model's KV per layer) still get them together. Memory is
    touched only as each tensor is taken, so packing weights into it one by one (freeing each
    original) never holds two copies of the model."""

    ALIGN = 64  # each tensor starts on a cache line

    def __init__(self, sizes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device | str = "cpu") -> None:
        total = sum(-(-_nbytes(shape, dtype) // self.ALIGN) * self.ALIGN for shape, dtype in sizes)
        self._buffer = _advised_empty(max(total, 1), torch.device(device))
        self._at = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next zero-filled tensor of this shape and dtype (in the order the sizes were given)."""
        nbytes = _nbytes(shape, dtype)
        if self._at + nbytes > self._buffer.numel():
            raise ValueError(f"arena exhausted: {nbytes} bytes asked, {self._buffer.numel() - self._at} left")
        out = self._buffer[self._at : self._at + nbytes].view(dtype).view(shape)
        self._at += -(-nbytes // self.ALIGN) * self.ALIGN
        return out.zero_()
