"""glibc keeps what an engine thread's step frees (tessera.engine.malloc_tuning): otherwise the
thread's arena hands the memory back to the kernel and the next step faults it in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

needs_glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                 reason="mallopt is glibc's")

# 8 MiB malloc'd, written and freed on a second thread (as the engine thread's activations are);
# prints how much the process's resident memory fell at the free, in KiB.
_FREED_KIB = r"""
import ctypes, sys, threading
from tessera.engine.malloc_tuning import keep_freed_memory
if sys.argv[1] == "on":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
out = []
def step():
    p = libc.malloc(8 << 20)
    ctypes.memset(p, 1, 8 << 20)
    before = rss()
    libc.free(p)
    out.append(before - rss())
t = threading.Thread(target=step)
t.start()
t.join()
print(out[0])
"""


def _freed_kib(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _FREED_KIB, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@needs_glibc
def test_freed_memory_stays_resident_with_the_tuning_and_not_without():
    assert _freed_kib("off") > 6 * 1024  # glibc's defaults: the 8 MiB go back at the free
    assert _freed_kib("on") < 1024  # kept for the next step


def test_off_by_environment(monkeypatch):
    from tessera.engine.malloc_tuning import keep_freed_memory

    monkeypatch.setenv("TESSERA_MALLOC_TUNING", "0")
    assert keep_freed_memory() is False
