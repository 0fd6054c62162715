"""The full-size load and overload runs of issue 11, with the figures printed as a table.

    flock /tmp/tessera-bench.lock .venv/bin/python -m tests.load.full_run            # 256 clients x 60 s
    flock /tmp/tessera-bench.lock .venv/bin/python -m tests.load.full_run --clients 64 --duration 15

Same scenarios as tests/unit/test_hardening_load.py (which runs them scaled down in CI): a
`tessera serve` subprocess on the tiny random model, `tessera bench load` from this process.
Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.load.harness import is_idle, run_load_scenario, run_overload_scenario
from tests.tiny_model import make_tiny_model_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--overload-s", type=float, default=30.0)
    p.add_argument("--capacity-s", type=float, default=10.0)
    p.add_argument("--skip-overload", action="store_true")
    args = p.parse_args(argv)
    model_dir = make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="tessera-load-")))
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    s = run_load_scenario(model_dir, clients=args.clients, duration=args.duration,
                          disconnect_fraction=args.disconnect_fraction, warmup_s=5)
    rss_ratio = s["rss_after_kib"] / s["rss_before_kib"]
    print(f"\n== load: {args.clients} streaming clients, {args.duration:g} s, {args.disconnect_fraction:.0%} hang up ==")
    rows = [("requests served (complete, checked)", s["completed"]), ("hung up on purpose", s["disconnected"]),
            ("errors", s["errors"]), ("malformed streams", s["malformed"]), ("rejected (503)", s["rejected"]),
            ("greedy texts that differ", s["inconsistent_prompts"]),
            ("served per second", f"{s['completed_per_s']:.1f}"),
            ("e2e latency p50 / p99 ms", f"{s['latency_ms']['p50']:.0f} / {s['latency_ms']['p99']:.0f}"),
            ("first chunk p99 ms", f"{s['ttft_ms']['p99']:.0f}"),
            ("RSS before / peak / after MiB", f"{s['rss_before_kib'] / 1024:.0f} / {s['rss_peak_kib'] / 1024:.0f} / "
                                              f"{s['rss_after_kib'] / 1024:.0f} ({rss_ratio - 1:+.1%})"),
            ("idle afterwards (no block, no request)", is_idle(s["idle_metrics"]))]
    for name, value in rows:
        print(f"  {name:<40} {value}")
    check(s["errors"] == 0 and s["malformed"] == 0 and s["inconsistent_prompts"] == 0, "load: bad answers")
    if s["errors"] or s["malformed"]:
        print("server log (tail):\n" + s["server_log_tail"])
    check(is_idle(s["idle_metrics"]), "load: not idle afterwards")
    check(rss_ratio <= 1.10, "load: RSS not back within 10%")

    if not args.skip_overload:
        r = run_overload_scenario(model_dir, capacity_s=args.capacity_s, overload_s=args.overload_s)
        cap, over = r["capacity"], r["overload"]
        print(f"\n== overload: 5x capacity, --max-num-seqs 4 --max-waiting-requests 4, {args.overload_s:g} s ==")
        rows = [("capacity (closed loop, 8 clients) req/s", f"{cap['completed_per_s']:.1f}"),
                ("offered req/s (target / sent)", f"{r['offered_rate']:.1f} / {over['sent'] / over['duration_s']:.1f}"),
                ("served", over["completed"]), ("served per second", f"{over['completed_per_s']:.1f}"),
                ("rejected (503)", over["rejected"]), ("errors + malformed", over["errors"] + over["malformed"]),
                ("503 latency p50 / p99 ms", f"{over['rejection_latency_ms']['p50']:.1f} / "
                                             f"{over['rejection_latency_ms']['p99']:.1f}"),
                ("served e2e p50 / p99 ms (capacity run p99)", f"{over['latency_ms']['p50']:.0f} / "
                                                               f"{over['latency_ms']['p99']:.0f} "
                                                               f"({cap['latency_ms']['p99']:.0f})"),
                ("RSS before / peak / after MiB", f"{r['rss_before_kib'] / 1024:.0f} / {r['rss_peak_kib'] / 1024:.0f}"
                                                  f" / {r['rss_after_kib'] / 1024:.0f}")]
        for name, value in rows:
            print(f"  {name:<44} {value}")
        check(over["errors"] == 0 and over["malformed"] == 0, "overload: bad answers")
        check(over["rejected"] > 0 and over["completed"] + over["rejected"] == over["sent"], "overload: accounting")
        check(over["rejection_latency_ms"]["p99"] < 500, "overload: slow 503s")
        check(r["rss_peak_kib"] <= 1.10 * r["rss_before_kib"], "overload: memory grew")
        check(is_idle(r["idle_metrics"]), "overload: not idle afterwards")

    print("\nall checks passed" if not failures else "\nFAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
