"""The C++ op library must build on every CPU CI and users have, not only the developer's: on a
Zen 3 (no AVX-512, no AMX) the AVX-512/AMX code is compiled by target pragmas and never called,
and the build must not fail (a failed build silently drops every kernel to the torch path)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

import tessera.kernels

CSRC = Path(tessera.kernels.__file__).parent / "csrc"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cpp")))
def test_each_kernel_source_compiles_for_a_cpu_without_avx512(tmp_path, source):
    # Compiled, not loaded (this process already registered the ops). -O0: code generation
    # still checks every always-inline intrinsic against its function's target.
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    cmd = ["g++", "-c", "-O0", "-march=znver3", "-std=c++20", "-fopenmp", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=1",
           *includes, str(CSRC / source), "-o", str(tmp_path / "out.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0, "\n".join(errors[:5])
