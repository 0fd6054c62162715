"""Time the sampler alone on one decode step's logits, for each kind of request parameters.

`Sampler.sample` on --rows x --vocab float32 logits (random, scaled by --scale and rounded to
bf16, as the default model's lm_head gives them: ties in the head), every row with the same
SamplingParams, each row with a --prompt-len prompt and --output-len generated tokens (what the
penalties count). Prints the median and min milliseconds per call for each case and writes JSON.
A case that costs several ms at 32 rows is a step's worth of engine overhead: compare with
benchmarks/engine_overhead.py's forward.

    python benchmarks/sampler.py
    python benchmarks/sampler.py --scale 0.5 --cases nucleus,seeded-nucleus   # flat rows
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from machine import cpu_name

from tessera.engine.sampler import Sampler
from tessera.sampling import SamplingParams

HERE = Path(__file__).resolve().parent

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top-k+top-p": dict(temperature=0.8, top_k=50, top_p=0.95),
    "nucleus": dict(temperature=0.8, top_p=0.95),
    "nucleus+min-p": dict(temperature=0.8, top_p=0.95, min_p=0.05),
    "seeded-temperature": dict(temperature=1.0, seed=1),
    "seeded-top-k+top-p": dict(temperature=0.8, top_k=50, top_p=0.95, seed=1),
    "seeded-nucleus": dict(temperature=0.8, top_p=0.95, seed=1),
    "repetition-penalty": dict(temperature=0.0, repetition_penalty=1.1),
    "presence-penalty": dict(temperature=0.7, presence_penalty=0.5),
    "frequency+nucleus": dict(temperature=0.7, top_p=0.9, frequency_penalty=0.5),
    "logprobs-0": dict(temperature=0.0, logprobs=0),
    "logprobs-5": dict(temperature=0.0, logprobs=5),
}


def time_case(params: SamplingParams, logits: torch.Tensor, prompts: list, outputs: list, repeats: int) -> list[float]:
    rows = logits.shape[0]
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(repeats + 3):
        # Seeded rows get fresh generators each call, as each request owns one.
        generators = [torch.Generator().manual_seed(r) if params.seed is not None else None for r in range(rows)]
        start = time.perf_counter()
        sampler.sample(logits, [params] * rows, outputs, prompts, generators)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--scale", type=float, default=3.0, help="logit scale: small = flat rows (wide nuclei)")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    ap.add_argument("--out", default=str(HERE / "results" / "sampler.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=gen) * args.scale).bfloat16().float()
    prompts = torch.randint(0, args.vocab, (args.rows, args.prompt_len), generator=gen).tolist()
    outputs = torch.randint(0, args.vocab, (args.rows, args.output_len), generator=gen).tolist()
    print(f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}; {args.rows} x {args.vocab} logits "
          f"(scale {args.scale}), prompts {args.prompt_len} + outputs {args.output_len} tokens a row")
    print(f"{'case':22s} {'median ms':>10s} {'min ms':>8s}")
    results = {}
    for name in args.cases.split(","):
        times = time_case(SamplingParams(**CASES[name]), logits, prompts, outputs, args.repeats)
        results[name] = {"params": CASES[name], "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}
        print(f"{name:22s} {results[name]['median_ms']:10.3f} {results[name]['min_ms']:8.3f}")
    Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "args": vars(args), "cases": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
