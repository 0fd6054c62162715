"""benchmarks/compare.py --rounds: which run stands for an engine, and the per-round ratios.
Runs built by hand; the expected picks and ratios worked out by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"
_spec = importlib.util.spec_from_file_location("compare_rounds_under_test", _PATH)
_mod = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _mod  # its dataclasses look their module up while the class is made
_spec.loader.exec_module(_mod)


def _offline(seconds: float, out_tok_s: float) -> dict:
    return {"ok": True, "throughput": {"seconds": seconds, "out_tok_s": out_tok_s}}


def _single(decode_tok_s: float) -> dict:
    return {"ok": True, "single": {"decode_tok_s": decode_tok_s, "ttft_s": 0.1}}


def test_offline_rounds_pick_the_median_offline_time() -> None:
    runs = [_offline(5.4, 760.0), _offline(5.0, 820.0), _offline(5.2, 790.0)]
    assert _mod.median_run(runs) is runs[2]
    # an even count takes the lower middle (the faster of the two middle runs)
    assert _mod.median_run(runs + [_offline(6.0, 680.0)]) is runs[2]


def test_single_stream_rounds_pick_the_median_decode_rate_not_the_last_run() -> None:
    runs = [_single(150.0), _single(120.0), _single(160.0)]
    assert _mod.median_run(runs) is runs[0]
    assert _mod.median_run(runs + [_single(90.0)]) is runs[1]  # 90, 120 | 150, 160: lower middle


def test_failed_runs_are_skipped_and_all_failed_gives_the_last() -> None:
    failed = {"ok": False, "error": "boom"}
    ok = _single(140.0)
    assert _mod.median_run([failed, ok, failed]) is ok
    assert _mod.median_run([failed, {"ok": False}]) == {"ok": False}


def test_round_summary_records_both_parts() -> None:
    run = {"ok": True, "measured_at": "t", "throughput": {"seconds": 5.0, "out_tok_s": 800.0},
           "single": {"decode_tok_s": 100.0, "ttft_s": 0.05}}
    assert _mod._round_summary(run) == {"ok": True, "seconds": 5.0, "out_tok_s": 800.0,
                                        "decode_tok_s": 100.0, "measured_at": "t"}


def test_single_stream_rounds_print_the_gguf_engine_against_llama_bench(capsys: pytest.CaptureFixture) -> None:
    runs = {"tessera-gguf": [_single(120.0), _single(150.0), _single(140.0)],
            "llama-bench": [_single(100.0), _single(100.0), _single(112.0)]}
    _mod.print_rounds(runs, ["tessera-gguf", "llama-bench"])
    out = capsys.readouterr().out
    assert "single-stream decode tok/s per round (tessera-gguf / engine in the same round)" in out
    assert "offline out tok/s" not in out  # that part did not run
    lines = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in "123median"]
    ratios = [float(words[-1].rstrip("x")) for words in lines]
    assert ratios == pytest.approx([1.20, 1.50, 1.25, 1.25])  # 140 / 112 = 1.25; the median of the three


def test_offline_rounds_print_tessera_against_each_engine(capsys: pytest.CaptureFixture) -> None:
    runs = {"tessera": [_offline(5.0, 800.0), _offline(5.2, 780.0)],
            "vllm": [_offline(7.0, 560.0), _offline(7.5, 600.0)]}
    _mod.print_rounds(runs, ["tessera", "vllm"])
    out = capsys.readouterr().out
    assert "offline out tok/s per round (tessera / engine in the same round)" in out
    assert "single-stream" not in out
    lines = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in "12median"]
    ratios = [float(words[-1].rstrip("x")) for words in lines]
    assert ratios == pytest.approx([800 / 560, 780 / 600, (800 / 560 + 780 / 600) / 2], abs=0.005)
