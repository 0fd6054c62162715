"""Engine work outside the model, per decode step: schedule, prepare inputs and metadata, sample,
detokenize and stop checks, measured on the real engine.

N concurrent requests (random token prompts, exactly --output-len generated, ignore_eos) run to
the end; every phase of every step is timed by wrapping the engine's own calls (the wrappers
cost well under a microsecond each). Only full decode steps (all N sequences decoding) go into
the table: median and mean per phase, in milliseconds. "forward" is the model alone (its
attention-metadata plan, if the backend builds one inside the forward, is listed apart as
"attn plan"); "other" is the rest of `step()` (bookkeeping between the phases).

    python benchmarks/engine_overhead.py                       # default model, bf16, batch 32
    python benchmarks/engine_overhead.py --tiny                # a tiny random model: overhead dominates
    python benchmarks/engine_overhead.py --sampling top-p --stop "\\n\\n" --json out.json
    python benchmarks/engine_overhead.py --sampling temperature --seeded   # the seeded race
    python benchmarks/engine_overhead.py --quantization gguf --batch 1 --sampling greedy
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from machine import cpu_name  # benchmarks/ is the script's folder

from tessera.bench.datasets import random_token_prompts
from tessera.config import DEFAULT_MODEL, EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.sampling import SamplingParams

PHASES = ("schedule", "prepare", "attn plan", "forward", "sample", "detok+stop", "other")
OVERHEAD = ("schedule", "prepare", "attn plan", "sample", "detok+stop", "other")


class PhaseTimer:
    """Seconds spent in each wrapped call during the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - t0
        return timed


def instrument(engine: LLMEngine, timer: PhaseTimer) -> None:
    """Wrap the engine's phase calls on the instances (and the attention plan, a module function)."""
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update_after_step = timer.wrap("schedule", engine.scheduler.update_after_step)
    engine.runner.prepare = timer.wrap("prepare", engine.runner.prepare)
    engine.runner.execute_argmax = timer.wrap("forward", engine.runner.execute_argmax)  # what step() calls
    engine.sampler.sample = timer.wrap("sample", engine.sampler.sample)
    engine._process_samples = timer.wrap("detok+stop", engine._process_samples)
    from tessera.attention import invariant_cpu

    if hasattr(invariant_cpu, "_kernel_plan"):
        invariant_cpu._kernel_plan = timer.wrap("attn plan", invariant_cpu._kernel_plan)


def sampling_params(kind: str, output_len: int, stop: list[str], seed: int | None = None,
                    min_p: float = 0.0) -> SamplingParams:
    common = dict(max_tokens=output_len, ignore_eos=True, stop=stop or None, seed=seed, min_p=min_p)
    if kind == "greedy":
        return SamplingParams(temperature=0.0, **common)
    if kind == "temperature":
        return SamplingParams(temperature=1.0, **common)
    if kind == "top-k":
        return SamplingParams(temperature=0.8, top_k=50, **common)
    if kind == "nucleus":  # top-p alone, as OpenAI clients send it
        return SamplingParams(temperature=0.8, top_p=0.95, **common)
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.95, **common)


def run(args: argparse.Namespace) -> dict:
    model = args.model
    if args.tiny:
        from tests.tiny_model import make_tiny_model_dir

        model = str(make_tiny_model_dir(Path(tempfile.mkdtemp()), num_layers=2, max_position_embeddings=4096))
    config = EngineConfig(model=model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(args.batch, 1),
                          max_num_batched_tokens=max(args.batch * args.input_len, 512), seed=0)
    engine = LLMEngine(config)
    timer = PhaseTimer()
    instrument(engine, timer)
    prompts = random_token_prompts(args.batch, args.input_len, engine.model_config.vocab_size, seed=1)
    for i, p in enumerate(prompts):
        # --seeded: every request its own seed (the OpenAI API's `seed`), so the seeded race runs.
        params = sampling_params(args.sampling, args.output_len, args.stop, seed=i if args.seeded else None,
                                 min_p=args.min_p)
        engine.add_request(f"overhead-{i}", p, params)
    rows: list[dict[str, float]] = []
    while engine.has_unfinished_requests():
        timer.current.clear()
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        phases = dict(timer.current)
        phases["forward"] = phases.get("forward", 0.0) - phases.get("attn plan", 0.0)
        phases["other"] = total - sum(phases.values())
        phases["total"] = total
        if engine._last_step == (args.batch, args.batch):  # a full decode step
            rows.append(phases)
    rows = rows[args.warmup_steps:]
    table = {}
    for name in (*PHASES, "total"):
        values = [r.get(name, 0.0) * 1e3 for r in rows]
        table[name] = {"median_ms": statistics.median(values), "mean_ms": statistics.fmean(values)}
    overhead = [sum(r.get(n, 0.0) for n in OVERHEAD) * 1e3 for r in rows]
    table["overhead (all but forward)"] = {"median_ms": statistics.median(overhead),
                                           "mean_ms": statistics.fmean(overhead)}
    return {
        "model": args.model if not args.tiny else "tiny-random",
        "dtype": args.dtype,
        "quantization": args.quantization,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "sampling": args.sampling,
        "seeded": args.seeded,
        "min_p": args.min_p,
        "stop": args.stop,
        "decode_steps_measured": len(rows),
        "cpu": cpu_name(),
        "phases": table,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of --model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", help="as `tessera generate --quantization` (e.g. gguf)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seeded", action="store_true", help="give every request a seed of its own")
    ap.add_argument("--min-p", type=float, default=0.0, help="min-p on top of --sampling")
    ap.add_argument("--sampling", choices=("greedy", "temperature", "top-k", "top-p", "nucleus"), default="top-p",
                    help="temperature: 1.0 alone, the OpenAI API's default")
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    ap.add_argument("--warmup-steps", type=int, default=4, help="decode steps left out of the table")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)
    result = run(args)
    print(f"engine overhead per decode step: {result['model']} {result['dtype']} quantization={result['quantization']}, batch {result['batch']}, "
          f"prompt {result['input_len']}, {result['output_len']} out, {result['sampling']} sampling, "
          f"stop={result['stop']}; {result['decode_steps_measured']} steps; CPU: {result['cpu']}")
    print(f"{'phase':<28}{'median ms':>12}{'mean ms':>12}")
    for name, t in result["phases"].items():
        print(f"{name:<28}{t['median_ms']:>12.3f}{t['mean_ms']:>12.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
