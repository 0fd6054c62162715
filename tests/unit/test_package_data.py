"""The package ships what it compiles at first use: every C++ source the native extensions build
(tessera/native.py's load_extension callers) is covered by pyproject.toml's package-data, so an
installed wheel builds the kernels instead of running the torch fallbacks."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
ROOT = Path(__file__).resolve().parents[2]


def test_every_native_source_is_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = [p for ext in ("*.cpp", "*.h") for p in (ROOT / "tessera").rglob(ext)]
    assert sources
    for path in sources:
        rel = path.relative_to(ROOT)
        covered = any(
            rel.parts[:len(pkg.split("."))] == tuple(pkg.split("."))
            and any(fnmatch("/".join(rel.parts[len(pkg.split(".")):]), pattern) for pattern in patterns)
            for pkg, patterns in package_data.items())
        assert covered, f"{rel} is not in pyproject.toml's package-data"
