"""Hand the OpenMP worker threads over to the engine thread.

Each thread that opens an OpenMP parallel region keeps a team of worker threads of its own. The
server loads the model on the main thread, then warms and steps it on the engine thread
(tessera.engine.async_engine), so the process ends up with two teams: four libgomp threads on a
two-core machine. libgomp lets a worker spin at the end of a region (so the next region, a few
microseconds later, starts without a futex wake-up) only while it manages no more threads than
there are CPUs; past that it spins 100 times instead of 300000 (its defaults) and sleeps, and
every one of the step's ~300 regions then waits for a wake-up. Measured on a 2-core Intel Xeon (model 167, bf16,
default model): 32 x 64 -> 32 generated from a second thread ran at 421-496 output tokens/s
against 704-729 on the thread that loaded the model, and at 605-713 once that thread's team
was released; `tessera serve` at a rate-inf `vllm bench serve` used 1.4 of the 2 cores.

`release_calling_thread_team()` frees the calling thread's team (OpenMP 5's
`omp_pause_resource_all`, which the runtime torch loaded implements; it returns -1 inside a
parallel region, and the team comes back at that thread's next region). Call it on the thread
that loaded the engine once another thread takes the engine over.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

logger = logging.getLogger("tessera")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: soft keeps the runtime's state, frees its threads
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def _loaded_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime already mapped into this process (torch's), never a second copy."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.count("/") else ""
        if any(Path(path).name.startswith(name) for name in _RUNTIMES):
            try:
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                continue
    return None


def release_calling_thread_team() -> bool:
    """Free the OpenMP worker threads the calling thread's parallel regions started; returns
    whether the runtime did (False: no OpenMP runtime loaded, none with OpenMP 5 pause, or
    called inside a parallel region)."""
    runtime = _loaded_runtime()
    pause = getattr(runtime, "omp_pause_resource_all", None) if runtime is not None else None
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    ok = pause(OMP_PAUSE_SOFT) == 0
    if not ok:
        logger.debug("omp_pause_resource_all refused (inside a parallel region?)")
    return ok


_warned_passive = False


def warn_if_passive() -> bool:
    """Log once per process when OMP_WAIT_POLICY=PASSIVE is set: every worker then sleeps at the
    end of each region, and a step of ~300 regions waits for as many wake-ups (one stream of the
    default model 47 against 24 ms a token on a 2-core Xeon, session 14). Returns whether it is set."""
    global _warned_passive
    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    if passive and not _warned_passive:
        _warned_passive = True
        logger.warning("OMP_WAIT_POLICY=PASSIVE: OpenMP workers sleep between the step's regions and each "
                       "step waits for their wake-ups (a decode step about twice as long on 2 cores); "
                       "unset it unless other work shares these cores")
    return passive
