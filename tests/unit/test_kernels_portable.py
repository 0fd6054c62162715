"""The C++ op libraries must build on every CPU CI and users have, not only the developer's: on a
Zen 3 (no AVX-512, no AMX) the AVX-512/AMX code is compiled by target pragmas and never called,
on a Zen 4 the AMX code, and the build must not fail (a failed build silently drops every kernel
to the torch path)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

import tessera.kernels
import tessera.quant
from tessera.quant import native_gemv

# Every C++ source Tessera builds, with the weakest CPU it is built on: the float kernels everywhere
# (Zen 3: no AVX-512), the quantized ones where AVX-512 is (Cooper Lake: AVX-512 BF16 without AMX,
# as Zen 4/5, which GCC 12 cannot name; gemv_avx2.cpp on Zen 3). The quantized library once built only where -march=native
# had AMX (its lambdas inlined AMX intrinsics untargeted). gemv.cpp also takes native_gemv's defines.
KERNELS, QUANT = Path(tessera.kernels.__file__).parent / "csrc", Path(tessera.quant.__file__).parent / "csrc"
SOURCES = {f"kernels/{p.name}": (p, "znver3") for p in sorted(KERNELS.glob("*.cpp"))} | \
          {f"quant/{p.name}": (p, "znver3" if p.stem.endswith("avx2") else "cooperlake")
           for p in sorted(QUANT.glob("*.cpp"))}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_each_kernel_source_compiles_for_the_weakest_cpu_it_is_built_on(tmp_path, source):
    # Compiled, not loaded (this process already registered the ops). -O0: code generation
    # still checks every always-inline intrinsic against its function's target.
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    includes.append(f"-I{KERNELS}")  # argmax_rows.h, which the real build stages beside both libraries' sources
    path, march = SOURCES[source]
    defines = [f"-D{d}" for d in (f"PREFETCH_BYTES={native_gemv.PREFETCH_BYTES}", f"PREFETCH_HINT={native_gemv.PREFETCH_HINT}")]
    cmd = ["g++", "-c", "-O0", f"-march={march}", "-std=c++20", "-fopenmp", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=1",
           *defines, *includes, str(path), "-o", str(tmp_path / "out.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0, "\n".join(errors[:5])
