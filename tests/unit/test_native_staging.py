"""Where tessera.native builds: two checkouts must never rebuild over each other's libraries.

ninja rebuilds a target whose compile command changed or whose source is newer than its object;
the command names the source's path and the torch installation's headers and libraries. So the
build compiles copies staged in the (content-keyed) build folder, the same paths whichever
checkout asks, a copy left untouched when unchanged; and each torch installation (a CI clone's
virtual environment) builds under a folder of its own.
"""

from __future__ import annotations

import os

import pytest

from tessera import native


def _checkout(root, text):
    folder = root / "csrc"
    folder.mkdir(parents=True)
    (folder / "a.cpp").write_text(text)
    (folder / "b.cpp").write_text("// b\n")
    return (folder / "a.cpp", folder / "b.cpp")


def test_two_checkouts_with_the_same_sources_compile_the_same_files(tmp_path):
    first = _checkout(tmp_path / "main", "// a\n")
    second = _checkout(tmp_path / "ci-clone", "// a\n")
    build = tmp_path / "build"
    staged = native.stage_sources(first, build)
    assert [p.read_text() for p in staged] == ["// a\n", "// b\n"]
    old = staged[0].stat().st_mtime_ns - 10**9  # as if written a second ago
    for p in staged:
        os.utime(p, ns=(old, old))
    again = native.stage_sources(second, build)
    assert again == staged  # the same paths in the compile commands
    assert all(p.stat().st_mtime_ns == old for p in again)  # untouched: nothing newer than the objects


def test_a_changed_source_is_rewritten(tmp_path):
    build = tmp_path / "build"
    native.stage_sources(_checkout(tmp_path / "one", "// a\n"), build)
    staged = native.stage_sources(_checkout(tmp_path / "two", "// a, changed\n"), build)
    assert staged[0].read_text() == "// a, changed\n"
    assert not list((build / "src").glob("*.tmp*"))  # written through a temporary file, renamed


def test_build_folders_follow_the_content_not_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    same = native.build_dir("x", _checkout(tmp_path / "main", "// a\n"))
    assert native.build_dir("x", _checkout(tmp_path / "clone", "// a\n")) == same
    assert native.build_dir("x", _checkout(tmp_path / "other", "// a2\n")) != same


def test_sources_with_one_file_name_are_refused(tmp_path):
    one, two = tmp_path / "x" / "k.cpp", tmp_path / "y" / "k.cpp"
    for p in (one, two):
        p.parent.mkdir()
        p.write_text("// k\n")
    with pytest.raises(ValueError, match="distinct file names"):
        native.stage_sources((one, two), tmp_path / "build")


def test_each_torch_installation_has_its_own_extension_folder(monkeypatch):
    """The compile commands name the installation's headers and libraries, so two virtual
    environments sharing one folder would rebuild it at every switch."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    here = native.extensions_root()
    monkeypatch.setattr(native.torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    elsewhere = native.extensions_root()
    assert here != elsewhere and here.parent == elsewhere.parent


def test_a_cold_build_says_it_is_compiling_before_it_starts(tmp_path, monkeypatch, caplog):
    """The first use of a set of sources compiles for about a minute: the log says so before the
    build starts; a library already built is loaded without that line."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    sources = _checkout(tmp_path / "main", "// a\n")
    seen: list[bool] = []

    def fake_load(name, build_directory, **_):
        seen.append(any("compiling native extension" in r.getMessage() for r in caplog.records))
        open(os.path.join(build_directory, f"{name}.so"), "w").close()

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    caplog.set_level("INFO", logger="tessera")
    assert native.load_extension.__wrapped__("probe", sources)
    assert seen == [True]  # announced before the compiler ran
    caplog.clear()
    assert native.load_extension.__wrapped__("probe", sources)
    assert seen == [True, False]
    assert not any("compiling" in r.getMessage() for r in caplog.records)


def test_a_header_is_staged_beside_the_sources_and_not_compiled(tmp_path, monkeypatch):
    """Two libraries share argmax_rows.h: each build stages it next to its .cpp files (their
    #include "..." finds it there), its content keys the build folder, and only the .cpp files are
    handed to the compiler."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, b = _checkout(tmp_path / "main", '#include "shared.h"\n')
    header = a.parent / "shared.h"
    header.write_text("// v1\n")
    compiled: list[list[str]] = []

    def fake_load(name, sources, build_directory, **_):
        compiled.append([os.path.basename(s) for s in sources])
        open(os.path.join(build_directory, f"{name}.so"), "w").close()

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert native.load_extension.__wrapped__("probe", (a, b, header))
    assert compiled == [["a.cpp", "b.cpp"]]
    built = native.build_dir("probe", (a, b, header))
    assert (built / "src" / "shared.h").read_text() == "// v1\n"
    header.write_text("// v2\n")
    assert native.build_dir("probe", (a, b, header)) != built
