"""Per-step cost of speculation: a plain decode step against verifying k proposals.

Runs one workload of benchmarks/speculative.py (default: the copying one at batch 1) once per
k, speculation fixed at k (0 = plain), and prints the median wall time of the decode steps by
the number of query tokens they ran, and how much of it was the model's forward pass. On a CPU
this is what decides whether speculation can pay: a verification of k proposals yields
1 + (accepted) tokens and costs step(k + 1 tokens) / step(1 token) plain steps.

    /tmp/tools/quiet .venv/bin/python benchmarks/speculative_steps.py --batch 1 --workload copy --ks 0,1,2,4,8,16
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speculative import set_speculation, workload  # noqa: E402

from tessera.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from tessera.engine.engine import LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--workload", default="copy", choices=["copy", "story"])
    ap.add_argument("--ks", default="0,1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-threads", type=int, default=1)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.num_threads))
    runner = engine.runner
    forward = runner.execute
    last: dict[str, float] = {}

    def timed_execute(step):
        start = time.perf_counter()
        logits = forward(step)
        last["forward"] = time.perf_counter() - start
        last["tokens"] = step.metadata.num_tokens
        return logits

    runner.execute = timed_execute
    times: dict[tuple[int, int], list[tuple[float, float]]] = collections.defaultdict(list)
    requests = workload(engine, args.workload, args.batch, args.max_tokens)
    for k in [int(x) for x in args.ks.split(",")]:
        set_speculation(engine, "ngram" if k else None, k, False, None)
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(f"{k}-{i}", prompt, params)
        prefilled = False
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            total = time.perf_counter() - start
            # Decode steps only: every running sequence had its prompt done before this step.
            if prefilled and all(s.num_computed_tokens == s.num_tokens - 1 for s in engine.scheduler.running):
                times[(k, int(last["tokens"]))].append((total, last["forward"]))
            prefilled = all(s.num_output_tokens > 0 for s in engine.scheduler.running)
    print(f"{'k':>3} {'query tokens':>12} {'steps':>5} {'step ms':>8} {'forward ms':>10} {'other ms':>8}")
    for (k, tokens), rows in sorted(times.items()):
        if len(rows) < 2:
            continue
        step_s = statistics.median(r[0] for r in rows)
        forward_s = statistics.median(r[1] for r in rows)
        print(f"{k:>3} {tokens:>12} {len(rows):>5} {step_s * 1e3:>8.1f} {forward_s * 1e3:>10.1f} "
              f"{(step_s - forward_s) * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
