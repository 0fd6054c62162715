"""Does it matter which thread steps the engine? One process, three cases, alternated in rounds:

- "loading thread": generate on the thread that loaded the model (the offline `LLM` case);
- "other thread, two teams": the loading thread has just run a torch op of its own (so it holds an
  OpenMP team again) and a new thread generates: four libgomp threads on two cores;
- "other thread, released": the same, after `release_calling_thread_team()` on the loading
  thread (what AsyncLLMEngine, the server's engine, does before its thread starts).

Each case generates the same batch (random prompts, greedy, exactly --output-len tokens) and
reports output tokens/s; the table gives each case's median over --rounds and its ratio to the
loading thread's. docs/engine.md, "Which thread steps the engine", says why. --keep-freed-memory
first applies AsyncLLMEngine's malloc thresholds (tessera.engine.malloc_tuning) to the whole run:
run the script with and without it to see what a new thread's own malloc arena costs.

    /tmp/tools/quiet .venv/bin/python benchmarks/engine_thread.py --json benchmarks/results/engine_thread.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
from machine import cpu_name  # benchmarks/ is the script's folder

from tessera import LLM, SamplingParams
from tessera.bench.datasets import random_token_prompts
from tessera.config import DEFAULT_MODEL
from tessera.engine.malloc_tuning import keep_freed_memory
from tessera.engine.openmp_team import release_calling_thread_team

CASES = ("loading thread", "other thread, two teams", "other thread, released")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="glibc keeps freed memory (what AsyncLLMEngine sets; process-wide, so for the whole run)")
    args = ap.parse_args(argv)
    if args.keep_freed_memory and not keep_freed_memory():
        raise SystemExit("--keep-freed-memory: glibc's mallopt is not available here")

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    seeds = iter(range(1, 10_000))

    def generate() -> float:
        prompts = random_token_prompts(args.batch, args.input_len, vocab, seed=next(seeds))
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return args.batch * args.output_len / (time.perf_counter() - t0)

    def on_new_thread() -> float:
        result = {}
        t = threading.Thread(target=lambda: result.update(rate=generate()))
        t.start()
        t.join()
        return result["rate"]

    def loading_thread_op() -> None:
        torch.ones(1 << 22).add_(1)  # any parallel torch op: this thread's team is back

    generate()  # warm-up
    rates: dict[str, list[float]] = {c: [] for c in CASES}
    for _ in range(args.rounds):
        loading_thread_op()
        rates[CASES[0]].append(generate())
        loading_thread_op()
        rates[CASES[1]].append(on_new_thread())
        loading_thread_op()
        release_calling_thread_team()
        rates[CASES[2]].append(on_new_thread())
    base = statistics.median(rates[CASES[0]])
    print(f"{args.model} {args.dtype}, {args.batch} x {args.input_len} -> {args.output_len}, {args.threads} threads, "
          f"{args.rounds} rounds, malloc {'tuned' if args.keep_freed_memory else 'defaults'}; CPU: {cpu_name()}")
    print(f"{'case':<26} {'out tok/s (median)':>19} {'all rounds':>24} {'vs loading thread':>18}")
    for c in CASES:
        med = statistics.median(rates[c])
        print(f"{c:<26} {med:19.1f} {' / '.join(f'{r:.0f}' for r in rates[c]):>24} {med / base:17.2f}x")
    result = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "batch": args.batch,
              "input_len": args.input_len, "output_len": args.output_len, "cpu": cpu_name(),
              "keep_freed_memory": args.keep_freed_memory,
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rates": rates}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
