"""`tessera bench throughput` and `tessera bench latency`: the offline engine, no server, in the
shape of `vllm bench throughput|latency`.

- throughput: all `--num-prompts` requests (random or ShareGPT-shaped, tessera/bench/datasets.py)
  are queued at once and stepped to completion; prints requests/s and tokens/s, and with `--plot`
  the output tokens/s over the run and the CDFs of time to first token and end-to-end latency.
- latency: `--num-iters` batches of `--batch-size` requests of `--input-len` prompt and
  `--output-len` generated tokens, each run alone after `--num-iters-warmup` untimed ones; prints
  the batch latency (mean, p50, p90, p99) with the TTFT and inter-token latency inside it, and with
  `--plot` their CDFs.

Both drive one LLMEngine's step loop directly and time each request's tokens as the steps return
them (greedy, ignore_eos, so every request generates exactly its output length). `--output-json`
writes the summary. Name the CPU next to any figure you report (`lscpu`).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from tessera.bench.datasets import BenchRequest, add_dataset_arguments, random_token_prompts, sample_requests
from tessera.bench.serve import percentiles
from tessera.config import DEFAULT_MODEL
from tessera.engine_args import add_engine_arguments, engine_kwargs
from tessera.sampling import SamplingParams


@dataclass
class RequestTiming:
    prompt_len: int
    output_len: int
    ttft: float | None = None  # seconds from the run's start
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between tokens (a step's several tokens share its gap)


@dataclass
class RunTrace:
    duration: float
    requests: list[RequestTiming]
    steps: list[tuple[float, int]]  # (seconds from start at the step's end, tokens it generated)


def build_engine(args: argparse.Namespace):
    from tessera.config import EngineConfig
    from tessera.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=args.model, **engine_kwargs(args)))


def run_requests(engine, requests: list[BenchRequest], tag: str) -> RunTrace:
    """Queue every request at once, step until all finish, and time what each step returned."""
    timings = {f"{tag}-{i}": RequestTiming(len(r.prompt_token_ids), r.output_len) for i, r in enumerate(requests)}
    last: dict[str, float] = {}
    steps: list[tuple[float, int]] = []
    start = time.perf_counter()
    for rid, r in zip(timings, requests, strict=True):
        engine.add_request(rid, r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        made = 0
        for out in outputs:
            t = timings.get(out.request_id)
            new = sum(len(c.delta_token_ids) for c in out.outputs)
            if t is None or not new:
                continue
            made += new
            if t.ttft is None:
                t.ttft = now
                new -= 1
            if new and out.request_id in last:
                t.itl += [(now - last[out.request_id]) / new] * new
            last[out.request_id] = now
            if out.finished:
                t.e2e = now
        steps.append((now, made))
    return RunTrace(time.perf_counter() - start, list(timings.values()), steps)


def _machine() -> dict:
    """The CPU to name next to the figures: its model, and the bf16/AMX flags that change them."""
    import torch

    name, flags = platform.processor() or platform.machine(), set()
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = set(next(line for line in info.splitlines() if line.startswith("flags")).split())
    except (OSError, StopIteration):
        pass
    extras = [f for f in ("avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return {"processor": name + (f" ({', '.join(extras)})" if extras else ""), "torch_threads": torch.get_num_threads()}


# ---- throughput ----------------------------------------------------------------------------------


def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, or the default model's name")
    add_dataset_arguments(p, input_len=128, output_len=None, num_prompts=64, seed=False)  # --seed: the engine's
    _add_output_arguments(p)
    add_engine_arguments(p)


def run_throughput(args: argparse.Namespace) -> dict:
    engine = build_engine(args)
    requests = sample_requests(args, lambda text: engine.tokenizer.encode(text, add_special_tokens=False),
                               engine.model_config.vocab_size, engine.max_model_len)
    run_requests(engine, requests[:2], "warmup")  # first steps build caches; not timed
    trace = run_requests(engine, requests, "bench")
    n_in = sum(r.prompt_len for r in trace.requests)
    n_out = sum(r.output_len for r in trace.requests)
    d = trace.duration
    summary = {
        "command": "throughput", "config": _config(args), "machine": _machine(),
        "elapsed_time": d, "num_requests": len(requests), "total_num_tokens": n_in + n_out,
        "prompt_tokens": n_in, "output_tokens": n_out,
        "requests_per_second": len(requests) / d, "tokens_per_second": (n_in + n_out) / d,
        "output_tokens_per_second": n_out / d,
        "ttft_ms": percentiles([r.ttft for r in trace.requests if r.ttft is not None]),
        "e2e_ms": percentiles([r.e2e for r in trace.requests if r.e2e is not None]),
        "steps": [{"t": t, "tokens": k} for t, k in trace.steps],
    }
    print(f"\nThroughput: {len(requests)} requests ({args.dataset_name}), {n_in} prompt + {n_out} output tokens, "
          f"{summary['machine']['processor']}, {summary['machine']['torch_threads']} torch threads")
    _print_rows([("elapsed", d, "s"), ("requests", summary["requests_per_second"], "req/s"),
                 ("total tokens", summary["tokens_per_second"], "tok/s"),
                 ("output tokens", summary["output_tokens_per_second"], "tok/s")])
    _print_percentiles(summary, ("ttft", "e2e"))
    if args.plot:
        from tessera.bench.plots import plot_throughput

        plot_throughput(trace.steps, {"TTFT": [r.ttft for r in trace.requests if r.ttft is not None],
                                      "end to end": [r.e2e for r in trace.requests if r.e2e is not None]},
                        args.plot, title=f"tessera bench throughput: {len(requests)} requests")
        print(f"wrote {args.plot}")
    _write_json(args, summary)
    return summary


# ---- latency -------------------------------------------------------------------------------------


def add_latency_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, or the default model's name")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--batch-size", type=int, default=8, help="requests run together in each iteration")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    _add_output_arguments(p)
    add_engine_arguments(p)


def run_latency(args: argparse.Namespace) -> dict:
    for flag in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1")
    if args.num_iters_warmup < 0:
        raise SystemExit("--num-iters-warmup must be >= 0")
    engine = build_engine(args)
    if args.input_len + args.output_len > engine.max_model_len:
        raise SystemExit(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the model's "
                         f"context of {engine.max_model_len} tokens (--max-model-len)")
    vocab = engine.model_config.vocab_size

    def batch(i: int) -> list[BenchRequest]:
        prompts = random_token_prompts(args.batch_size, args.input_len, vocab, args.seed + i)
        return [BenchRequest(p, args.output_len) for p in prompts]

    for i in range(args.num_iters_warmup):
        run_requests(engine, batch(-1 - i), f"warmup{i}")
    traces = [run_requests(engine, batch(i), f"iter{i}") for i in range(args.num_iters)]
    latencies = [t.duration for t in traces]
    ttft = [r.ttft for t in traces for r in t.requests if r.ttft is not None]
    itl = [g for t in traces for r in t.requests for g in r.itl]
    summary = {
        "command": "latency", "config": _config(args), "machine": _machine(),
        "avg_latency": sum(latencies) / len(latencies), "latencies": latencies,
        "percentiles": {str(p): _pct(latencies, p) for p in (10, 25, 50, 75, 90, 99)},
        "latency_ms": percentiles(latencies), "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl),
    }
    print(f"\nLatency: {args.num_iters} iterations of {args.batch_size} requests x {args.input_len} in x "
          f"{args.output_len} out, {summary['machine']['processor']}, {summary['machine']['torch_threads']} torch "
          "threads")
    _print_rows([("avg latency", summary["avg_latency"], "s"),
                 ("output tokens", args.batch_size * args.output_len / summary["avg_latency"], "tok/s")])
    _print_percentiles(summary, ("latency", "ttft", "itl"))
    if args.plot:
        from tessera.bench.plots import plot_latency_cdfs

        plot_latency_cdfs({"batch latency": latencies, "TTFT": ttft, "inter-token": itl}, args.plot,
                          title=f"tessera bench latency: batch {args.batch_size}, {args.input_len} in, "
                                f"{args.output_len} out")
        print(f"wrote {args.plot}")
    _write_json(args, summary)
    return summary


# ---- shared --------------------------------------------------------------------------------------


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-json", default=None, help="write the summary as JSON here")
    p.add_argument("--plot", default=None, metavar="PNG", help="write plots here (needs matplotlib: the plots extra)")


def _config(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not callable(v)}


def _pct(values: list[float], p: float) -> float:
    """The p-th percentile, interpolated between the closest ranks (as numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _print_rows(rows: list[tuple[str, float, str]]) -> None:
    for name, value, unit in rows:
        print(f"  {name:<16}{value:12.2f} {unit}")


def _print_percentiles(summary: dict, keys: tuple[str, ...]) -> None:
    print(f"\n  {'ms':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in keys:
        row = summary[f"{key}_ms"]
        cells = "".join(f"{row[p]:10.2f}" if row[p] is not None else f"{'-':>10}" for p in ("mean", "p50", "p90", "p99"))
        print(f"  {key.upper():<10}{cells}")


def _write_json(args: argparse.Namespace, summary: dict) -> None:
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(summary, indent=2, default=str))
        print(f"wrote {args.output_json}")


def add_offline_commands(bench_sub) -> None:
    """`tessera bench throughput` and `tessera bench latency` under the `bench` subparsers."""
    thr = bench_sub.add_parser("throughput", help="offline throughput of the engine (no server), as vllm bench")
    add_throughput_arguments(thr)
    thr.set_defaults(func=lambda args: run_throughput(args) and 0)  # the CLI's exit code, not the summary
    lat = bench_sub.add_parser("latency", help="offline latency of one batch (no server), as vllm bench")
    add_latency_arguments(lat)
    lat.set_defaults(func=lambda args: run_latency(args) and 0)
