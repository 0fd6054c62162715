"""The native decoder stack against the module path (`--enforce-eager`), in one process.

One engine on the default model; the same engine's model runs each case with its native stack
(tessera/model/native_stack.py: one call for all layers) and with it taken away (the modules,
op by op), alternating, so both see the same machine minute. Cases: decode steps at a few batch
sizes (each sequence with a 256-token context) and a 256-token prefill step. Prints the median
step time of each and their ratio, and writes JSON.

    /tmp/tools/quiet .venv/bin/python benchmarks/native_stack.py --quantization none,gguf
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from machine import cpu_name

from tessera import LLM, SamplingParams

HERE = Path(__file__).resolve().parent


def _decode_ms(engine, rng: random.Random, batch: int, context: int, steps: int) -> float:
    params = SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0.0)
    ids = [f"d{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, 40000) for _ in range(context)], params)
    while engine.scheduler.num_waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request(ids)
    engine.step()
    return statistics.median(times) * 1e3


def _prefill_ms(engine, rng: random.Random, tokens: int, reps: int) -> float:
    params = SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0.0)
    times = []
    for _ in range(reps):
        engine.add_request("p", [rng.randrange(100, 40000) for _ in range(tokens)], params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        engine.abort_request("p")
        engine.step()
    return statistics.median(times) * 1e3


def _measure(mode: str, args: argparse.Namespace) -> list[dict]:
    """Every case of one quantization mode, native stack and modules alternating."""
    llm = LLM(args.model, quantization=mode, enable_prefix_caching=False, num_threads=args.threads)
    engine, model = llm.engine, llm.engine.runner.model
    stack = model.native_stack
    if stack is None:
        print(f"{mode}: no native stack for this model here (the module path only); skipped")
        return []
    rng = random.Random(0)
    cases = [(f"decode b{b}", lambda b=b: _decode_ms(engine, rng, b, args.context, args.steps))
             for b in (int(v) for v in args.batch_sizes.split(","))]
    cases.append((f"prefill {args.prefill}", lambda: _prefill_ms(engine, rng, args.prefill, 5)))
    rows = []
    for name, run in cases:
        native, modules = [], []
        for _ in range(args.rounds):
            model.native_stack = stack
            native.append(run())
            model.native_stack = None
            modules.append(run())
        model.native_stack = stack
        row = dict(quantization=mode, case=name, native_ms=statistics.median(native),
                   modules_ms=statistics.median(modules), native_all=native, modules_all=modules)
        row["speedup"] = row["modules_ms"] / row["native_ms"]
        rows.append(row)
        print(f"{mode:6s} {name:14s} native {row['native_ms']:7.2f} ms   modules {row['modules_ms']:7.2f} ms   "
              f"x{row['speedup']:.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="none", help="comma-separated modes, one engine each")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="native / modules alternations per case")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "native_stack.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for mode in args.quantization.split(",") for row in _measure(mode, args)]
    out = dict(cpu=cpu_name(), threads=args.threads, model=args.model, context=args.context, results=rows)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"{cpu_name()}, {args.threads} threads; wrote {args.out}")


if __name__ == "__main__":
    main()
