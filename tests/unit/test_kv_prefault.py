"""tessera.engine.kv_prefault: the server's KV pool made resident on an idle-priority thread.

Residency is read back with mincore(2), not taken from the code's own bookkeeping; contents
written before (a block in use) must come through unchanged, since the engine writes the same
memory while the thread runs."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from tessera import memory
from tessera.engine.kv_prefault import KVPrefaulter, populate

PAGE = 4096


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages of t's memory, by mincore."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = t.data_ptr() & ~(PAGE - 1)
    end = (t.data_ptr() + t.numel() * t.element_size() + PAGE - 1) & ~(PAGE - 1)
    pages = (end - start) // PAGE
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw), pages


def _pool(num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three layers of (K, V) as allocate_kv_cache lays them out: one fresh arena, lazily resident."""
    shape = (num_blocks * block_size, 2, 64)
    arena = memory.Arena([(shape, torch.float32)] * 6)
    return [(arena.take(shape, torch.float32), arena.take(shape, torch.float32)) for _ in range(3)]


def _can_populate() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    probe = memory.zeros((memory.MIN_BYTES,), torch.uint8)  # kept alive across the call
    return populate(probe.data_ptr(), PAGE)


needs_populate = pytest.mark.skipif(not _can_populate(), reason="needs Linux with madvise(MADV_POPULATE_WRITE) (5.14+)")


@needs_populate
def test_the_whole_pool_becomes_resident_and_its_contents_stay():
    caches = _pool(num_blocks=300, block_size=16)  # 6 tensors of 2.4 MB
    k0 = caches[0][0]
    k0[16:32] = 3.5  # block 1 in use: written before the thread starts
    before = sum(_resident_pages(t)[0] for layer in caches for t in layer)
    total = sum(_resident_pages(t)[1] for layer in caches for t in layer)
    assert before < total // 10  # fresh memory: only what was written

    prefault = KVPrefaulter(caches, block_size=16).start()
    prefault.join(timeout=60)

    assert prefault.done_blocks == 300
    for layer in caches:
        for t in layer:
            resident, pages = _resident_pages(t)
            assert resident == pages
    assert torch.equal(k0[16:32], torch.full_like(k0[16:32], 3.5))
    assert not k0[:16].any() and not k0[32:].any()  # populated pages read as zeros, nothing written
    assert all(not t.any() for layer in caches[1:] for t in layer)


def test_nothing_runs_without_cpu_tensors():
    prefault = KVPrefaulter([(torch.empty(0), torch.empty(0))], block_size=16).start()
    prefault.join(timeout=0)  # no thread to wait for
    assert prefault.num_blocks == 0 and prefault.done_blocks == 0


def test_the_server_starts_one_unless_told_not_to(tiny_model_dir):
    from tessera.config import EngineConfig
    from tessera.server.app import create_app

    def config():
        return EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=128, num_threads=1)

    app = create_app(config(), served_model_name="tiny", warmup=False)
    try:
        prefault = app.state.kv_prefault
        prefault.join(timeout=60)
        blocks = app.state.engine.engine.runner.kv_caches[0][0].shape[0] // app.state.engine.engine.runner.block_size
        assert prefault.num_blocks == blocks and (prefault.done_blocks == blocks or not _can_populate())
    finally:
        app.state.engine.shutdown()
    lazy = create_app(config(), served_model_name="tiny", warmup=False, kv_prefault=False)
    try:
        assert lazy.state.kv_prefault is None
    finally:
        lazy.state.engine.shutdown()
