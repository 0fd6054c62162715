"""tessera.memory: huge-page CPU buffers are plain zero-filled tensors, advised before first touch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tessera import memory


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("shape", [(7, 3), (3000, 3, 1024)])  # below and above MIN_BYTES
def test_zeros_is_torch_zeros(shape, dtype):
    x = memory.zeros(shape, dtype)
    assert x.shape == shape and x.dtype == dtype and x.is_contiguous()
    assert torch.equal(x, torch.zeros(shape, dtype=dtype))
    x.fill_(1)  # writable, and the view keeps its buffer alive
    assert int(x.to(torch.float32).sum()) == x.numel()


def test_zeros_advises_the_aligned_interior_before_filling(monkeypatch):
    calls = []

    def fake_madvise(addr, length, advice):
        calls.append((addr, length, advice))
        return 0

    monkeypatch.setattr(memory, "_madvise", lambda: fake_madvise)
    shape = (5 << 20,)  # 5 MiB of bytes
    x = memory.zeros(shape, torch.uint8)
    assert torch.equal(x, torch.zeros(shape, dtype=torch.uint8))
    (addr, length, advice), = calls
    huge = 2 << 20
    assert advice == 14 and addr % huge == 0 and length % huge == 0 and length == (5 << 20) // huge * huge
    assert x.data_ptr() == addr  # the tensor starts at the advised, aligned address
    calls.clear()
    memory.zeros((1024,), torch.float32)  # small: never advised
    assert calls == []


def test_arena_hands_out_disjoint_aligned_zero_tensors():
    sizes = [((5, 7), torch.bfloat16), ((3,), torch.float32), ((1 << 20,), torch.int8)]
    arena = memory.Arena(sizes)
    parts = [arena.take(shape, dtype) for shape, dtype in sizes]
    for (shape, dtype), t in zip(sizes, parts, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.data_ptr() % 64 == 0
        assert not t.any()
    parts[1].fill_(3.0)  # writing one leaves the others as they were
    assert not parts[0].any() and not parts[2].any() and torch.equal(parts[1], torch.full((3,), 3.0))
    with pytest.raises(ValueError, match="arena exhausted"):
        arena.take((1,), torch.float32)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_an_arena_touches_memory_only_as_tensors_are_taken():
    """Packing a model's weights into one arena must not hold a second full copy up front."""
    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = rss_mib()
    arena = memory.Arena([((64 << 20,), torch.uint8)] * 4)  # 256 MiB
    assert rss_mib() - before < 32
    first = arena.take((64 << 20,), torch.uint8)
    assert 48 < rss_mib() - before < 112 and not first.any()
