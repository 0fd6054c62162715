"""tessera.memory: fresh-mapping CPU buffers are plain zero-filled tensors, untouched until used,
huge-page buffers advised on their 2 MiB-aligned part."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from tessera import memory

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings and /proc are Linux's")


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("shape", [(7, 3), (3000, 3, 1024)])  # below and above MIN_BYTES
def test_zeros_is_torch_zeros(shape, dtype, huge):
    x = memory.zeros(shape, dtype, huge=huge)
    assert x.shape == shape and x.dtype == dtype and x.is_contiguous()
    assert torch.equal(x, torch.zeros(shape, dtype=dtype))
    x.fill_(1)  # writable, and the view keeps its mapping alive
    assert int(x.to(torch.float32).sum()) == x.numel()


@linux
def test_huge_buffers_are_advised_on_their_aligned_part(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_advise", lambda mm, start, length: calls.append((mm, start, length)))
    x = memory.zeros((5 << 20,), torch.uint8, huge=True)  # 5 MiB
    (mm, start, length), = calls
    huge = 2 << 20
    assert isinstance(mm, mmap.mmap) and length == (5 << 20) // huge * huge
    assert x.data_ptr() % huge == 0  # the tensor starts where the advised range does
    calls.clear()
    memory.zeros((5 << 20,), torch.uint8)  # not huge: never advised
    memory.zeros((1024,), torch.float32, huge=True)  # small: torch's allocator
    assert calls == []


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@linux
def test_an_arena_is_resident_only_where_written():
    """A 256 MiB KV pool costs no memory (and no start-up time) until blocks are used; packing a
    model's weights into an arena one by one never holds a second full copy."""
    before = _rss_mib()
    arena = memory.Arena([((64 << 20,), torch.uint8)] * 4)
    parts = [arena.take((64 << 20,), torch.uint8) for _ in range(4)]
    assert _rss_mib() - before < 16
    parts[0].fill_(1)
    assert 48 < _rss_mib() - before < 112


def test_arena_hands_out_disjoint_aligned_zero_tensors():
    sizes = [((5, 7), torch.bfloat16), ((3,), torch.float32), ((1 << 23,), torch.int8)]
    arena = memory.Arena(sizes)
    parts = [arena.take(shape, dtype) for shape, dtype in sizes]
    for (shape, dtype), t in zip(sizes, parts, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.data_ptr() % 64 == 0
        assert not t.any()
    parts[1].fill_(3.0)  # writing one leaves the others as they were
    assert not parts[0].any() and not parts[2].any() and torch.equal(parts[1], torch.full((3,), 3.0))
    with pytest.raises(ValueError, match="arena exhausted"):
        arena.take((1,), torch.float32)
