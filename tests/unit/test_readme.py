"""The README against the code: its flag table is the parser's, every `tessera ...` command in its
code blocks parses (the cheap ones run), every flag it names exists, its Python parses."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path

import pytest

from tessera.cli import build_parser, main
from tessera.flag_table import END, START, serve_flag_table

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)


def _commands() -> list[list[str]]:
    """Every `tessera ...` command line of the README's bash blocks, as argv after `tessera`."""
    found = []
    for lang, body in BLOCKS:
        if lang != "bash":
            continue
        for line in body.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("tessera "):
                found.append(shlex.split(line)[1:])
    return found


def _all_option_strings() -> set[str]:
    from tessera.bench.serve import build_parser as bench_serve_parser

    _, subs = build_parser()
    parsers = [*subs.values(), bench_serve_parser(), build_parser()[0]]
    return {s for p in parsers for a in p._actions for s in a.option_strings}


def test_the_flag_table_is_generated_from_the_parser():
    table = README.split(START, 1)[1].split(END, 1)[0]
    assert table.strip() == serve_flag_table().strip(), "run `python -m tessera.flag_table --write`"


def test_the_readme_has_commands_to_check():
    commands = _commands()
    assert len(commands) >= 10
    assert ["--version"] in commands and any(c[:1] == ["serve"] for c in commands)


@pytest.mark.parametrize("argv", _commands(), ids=lambda a: " ".join(a)[:60])
def test_every_readme_command_parses_and_the_cheap_ones_run(argv, capsys, monkeypatch):
    if argv in (["--version"], ["serve", "--help"]) or "--help" in argv:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
        assert capsys.readouterr().out.strip()
        return
    if argv[:2] == ["bench", "serve"]:
        from tessera.bench.serve import build_parser as bench_serve_parser

        bench_serve_parser().parse_args(argv[2:])
        return
    monkeypatch.setenv("KEY", "k")
    parser, _ = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:  # argparse refused it
        pytest.fail(f"`tessera {' '.join(argv)}` does not parse (exit {exc.code}): {capsys.readouterr().err}")


def test_every_flag_the_readme_names_exists():
    known = _all_option_strings()
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?![\w*-])", README))
    # Other tools' flags in examples: huggingface-cli's, `ray start`'s, python -m tessera.flag_table's.
    not_tessera = {"--local-dir", "--head", "--write",
                   # benchmarks/*.py, python -m tests.differential, docker compose
                   "--baseline", "--batch-size", "--build", "--cases"}
    missing = sorted(named - known - not_tessera)
    assert not missing, f"the README names flags no parser has: {missing}"


def test_the_readme_python_parses_and_imports_what_exists():
    blocks = [body for lang, body in BLOCKS if lang == "python"]
    assert blocks
    for body in blocks:
        tree = ast.parse(body)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "tessera":
                import tessera

                for alias in node.names:
                    assert getattr(tessera, alias.name) is not None


def test_the_readme_links_to_docs_that_exist():
    for link in re.findall(r"\]\((docs/[^)]+)\)", README):
        assert (ROOT / link).is_file(), link


def test_the_make_targets_the_readme_names_exist():
    makefile = (ROOT / "Makefile").read_text()
    for target in set(re.findall(r"\bmake ([a-z-]+)", README)):
        assert re.search(rf"^{target}:", makefile, flags=re.M), target


def test_the_readme_parser_check_would_catch_an_unknown_flag():
    parser, _ = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--no-such-flag"])
    assert isinstance(parser, argparse.ArgumentParser)
