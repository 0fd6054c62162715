"""Build-once C++ extensions: compile at first use with torch's cpp_extension, cache, fall back.

`load_extension(name, sources)` compiles the .cpp sources (with -O3 -march=native; .h sources are
staged beside them for their `#include "..."` and count in the cache key) into a shared
library that registers torch ops, caches it under `$TORCH_EXTENSIONS_DIR` (default
`$TESSERA_CACHE/torch_extensions/<torch version>-<cpu>-<torch install>`, so a different CPU or
torch rebuilds, and two environments never rebuild over each other's libraries: the build
commands name the installation's headers and libraries)
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


def _torch_tag() -> str:
    """Short hash of where this torch is installed: ninja rebuilds a library whose compile
    command changed, and the command names that installation's include and library folders, so a
    second virtual environment (a CI clone's) sharing one folder rebuilt it at every switch."""
    return hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]


def extensions_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    cache = Path(os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")
    return cache / "torch_extensions" / f"torch{torch.__version__.split('+')[0]}-{_cpu_tag()}-{_torch_tag()}"


def build_dir(name: str, sources: tuple[Path, ...] = (), defines: tuple[str, ...] = ()) -> Path:
    """Where `name` is built: one folder per content of its sources and defines, so two
    checkouts (or branches) with different sources never rebuild over each other's library, and
    (with stage_sources) two with the same sources share one."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(Path(source).read_bytes())
    digest.update("\0".join(defines).encode())
    path = extensions_root() / (f"{name}-{digest.hexdigest()[:10]}" if sources or defines else name)
    path.mkdir(parents=True, exist_ok=True)
    return path


def stage_sources(sources: tuple[Path, ...], directory: Path) -> list[Path]:
    """Copies of `sources` in `directory`/src, the files the build compiles. ninja rebuilds when a
    compile command changes, and the command names the source's path: built from each checkout's
    own files, a second checkout with the same sources rebuilt the shared library every time the
    two alternated, ~40 s at the next start (with a CI clone, whose own virtual environment also
    changes the command, _torch_tag is the other half: the "first start" of sessions 23-24's serve
    runs). A copy is written only when missing or different (atomically: another process may be
    staging the same folder), so an unchanged source keeps its time and ninja has nothing to redo."""
    src = directory / "src"
    src.mkdir(parents=True, exist_ok=True)
    names = [Path(source).name for source in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"native sources must have distinct file names: {names}")
    staged = []
    for source in sources:
        data = Path(source).read_bytes()
        target = src / Path(source).name
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        staged.append(target)
    return staged


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
    directory = build_dir(name, sources, defines)
    clear_stale_lock(directory)
    if not (directory / f"{name}.so").is_file():
        # A cold start spends most of its time here: say so before the wait, not after it.
        logger.info("compiling native extension %s (first use of these sources with this torch and CPU, "
                    "about a minute; cached in %s)", name, directory)
    try:
        cpp_extension.load(
            name=name,
            # headers are staged beside the sources (their #include "..." finds them) and hashed
            # into the build folder's name, but only the .cpp files are compiled
            sources=[str(s) for s in stage_sources(sources, directory) if s.suffix != ".h"],
            extra_cflags=CFLAGS + [f"-D{d}" for d in defines],
            build_directory=str(directory),
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
        logger.info("native extension %s built in %.0f s (cached in %s)", name, elapsed, directory)
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
