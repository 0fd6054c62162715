"""Build-once C++ extensions: compile at first use with torch's cpp_extension, cache, fall back.

`load_extension(name, sources)` compiles the sources (with -O3 -march=native) into a shared
library that registers torch ops, caches it under `$TORCH_EXTENSIONS_DIR` (default
`$TESSERA_CACHE/torch_extensions/<torch version>-<cpu>`, so a different CPU or torch rebuilds)
and loads it. It returns False, logging one warning that names the reason, when the build or the
load fails, or when `TESSERA_NATIVE=0`; callers then keep their pure-torch kernels. Each name is
tried once per process. `python -m tessera.native` builds every registered extension ahead of
time (`make setup` runs it) and prints what it built.

Any extension can use it: give it a stable name and its sources, and register it in
`EXTENSIONS` so the ahead-of-time build knows it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger("tessera")

# name -> (module that owns it, its function that loads it); the ahead-of-time build calls them.
EXTENSIONS = {
    "tessera_gemv": ("tessera.quant.native_gemv", "available"),
    "tessera_invariant": ("tessera.kernels", "available"),
    "tessera_qgemm": ("tessera.quant.invariant", "available"),
}

CFLAGS = ["-O3", "-march=native", "-std=c++20", "-fno-math-errno", "-fopenmp"]


def enabled() -> bool:
    return os.environ.get("TESSERA_NATIVE", "1") != "0"


def _cpu_tag() -> str:
    """Short hash of the CPU model and flags: a -march=native build is only valid on its CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]


def extensions_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    cache = Path(os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")
    return cache / "torch_extensions" / f"torch{torch.__version__.split('+')[0]}-{_cpu_tag()}"


def build_dir(name: str, sources: tuple[Path, ...] = (), defines: tuple[str, ...] = ()) -> Path:
    """Where `name` is built: one folder per content of its sources and defines, so two
    checkouts (or branches) with different sources never rebuild over each other's library."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(Path(source).read_bytes())
    digest.update("\0".join(defines).encode())
    path = extensions_root() / (f"{name}-{digest.hexdigest()[:10]}" if sources or defines else name)
    path.mkdir(parents=True, exist_ok=True)
    return path


STALE_LOCK_S = 600  # a build takes about a minute; a lock this old was left by a killed build


def clear_stale_lock(build_directory: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove cpp_extension's `lock` file when it is older than max_age_s: a build interrupted
    (Ctrl-C, a killed test run) leaves it behind, and the next start would wait for it forever.
    Returns whether one was removed."""
    lock = Path(build_directory) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    logger.warning("native extension build: removing a lock left %.0f s ago by an interrupted build (%s)", age, lock)
    lock.unlink(missing_ok=True)
    return True


@functools.cache
def load_extension(name: str, sources: tuple[Path, ...], defines: tuple[str, ...] = ()) -> bool:
    """Build (or reuse) and load the op library `name`; True when its ops are registered.
    `defines` ("NAME=VALUE") become -D flags."""
    if not enabled():
        logger.info("native extension %s: off (TESSERA_NATIVE=0); using the torch kernels", name)
        return False
    from torch.utils import cpp_extension

    start = time.perf_counter()
    clear_stale_lock(build_dir(name, sources, defines))
    try:
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=CFLAGS + [f"-D{d}" for d in defines],
            build_directory=str(build_dir(name, sources, defines)),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build or load failure means: use the fallback
        first = str(e).strip().splitlines()
        logger.warning("native extension %s could not be built (%s); using the slower torch kernels. "
                       "Set TESSERA_NATIVE=0 to skip the attempt.", name, first[-1] if first else type(e).__name__)
        return False
    elapsed = time.perf_counter() - start
    if elapsed > 2:
        logger.info("native extension %s built in %.0f s (cached in %s)", name, elapsed,
                    build_dir(name, sources, defines))
    return True


def main() -> int:
    """Build every registered extension now; exit status 1 if one failed."""
    import importlib

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failed = []
    for name, (module, fn) in EXTENSIONS.items():
        ok = getattr(importlib.import_module(module), fn)()
        print(f"{name}: {'built' if ok else 'NOT built (torch fallback)'} under {extensions_root()}")
        if not ok:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
