"""Offline throughput: Tessera's engine against the naive transformers baseline, same model, same work.

N requests of random token ids (input_len prompt tokens, exactly output_len generated, ignore_eos).
Prints a table and writes JSON. Also breaks one decode step down into time spent in the model's
matmuls and attention versus everything else (Python and framework overhead).

    python benchmarks/throughput.py --num-requests 32 --input-len 256 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from tessera import LLM, SamplingParams
from tessera.bench.datasets import random_token_prompts
from tessera.config import DEFAULT_MODEL, resolve_dtype

KERNEL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
              "aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::baddbmm")


# The prompts of `tessera bench throughput --dataset-name random` (one definition of "random prompts").
make_prompts = random_token_prompts


def run_tessera(llm: LLM, prompts: list[list[int]], output_len: int, sampling: dict | None = None) -> float:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **(sampling or {"temperature": 0.0}))
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return elapsed


def decode_step_breakdown(llm: LLM, batch: int, context: int, steps: int = 8) -> dict:
    """Time decode steps at a given batch and context; split kernel time from the rest."""
    engine = llm.engine
    prompts = make_prompts(batch, context, engine.model_config.vocab_size, seed=1)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"breakdown-{i}", p, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    engine.step()  # warm
    step_times = []
    kernel_us = 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
    for evt in prof.key_averages():
        if evt.key.startswith(KERNEL_OPS):
            kernel_us += evt.self_cpu_time_total
    engine.abort_request([f"breakdown-{i}" for i in range(batch)])
    # Profiling adds its own overhead: time the same steps again without it for the step time.
    step_ms = 1000 * sum(step_times) / steps
    kernel_ms = kernel_us / 1000 / steps
    return {"batch": batch, "context": context, "step_ms_profiled": step_ms, "kernel_ms": kernel_ms,
            "overhead_ms": step_ms - kernel_ms, "overhead_frac": (step_ms - kernel_ms) / step_ms}


def run_hf_baseline(model_path: Path, prompts: list[list[int]], output_len: int, dtype: torch.dtype,
                    batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    if model_path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    hf.eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            # Equal-length prompts: a static batch needs no padding here, its best case.
            ids = torch.tensor(prompts[i : i + batch_size])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                              min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + output_len
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--baseline", choices=["none", "one", "static", "both"], default="both")
    ap.add_argument("--baseline-requests", type=int, default=None,
                    help="run the (slow) one-at-a-time baseline on this many requests and scale to N")
    ap.add_argument("--static-batch", type=int, default=8)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="Tessera's sampling (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None, help="one seed for every request")
    ap.add_argument("--out", default="results/throughput.json")
    args = ap.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, num_threads=args.num_threads)
    vocab = llm.engine.model_config.vocab_size
    prompts = make_prompts(args.num_requests, args.input_len, vocab, seed=0)
    # --temperature/--top-p/--seed: the sampling a client sends (the README's example: 0.7, 0.9, 0)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    run_tessera(llm, prompts[:2], 4, sampling)  # warm-up
    elapsed = run_tessera(llm, prompts, args.output_len, sampling)
    n_in, n_out = args.num_requests * args.input_len, args.num_requests * args.output_len
    rows = [("tessera", elapsed, 1.0)]
    breakdown = [decode_step_breakdown(llm, b, args.input_len) for b in (1, min(32, args.num_requests))]

    dtype = resolve_dtype(args.dtype)
    model_path = llm.engine.model_path
    del llm
    if args.baseline in ("one", "both"):
        k = args.baseline_requests or args.num_requests
        t = run_hf_baseline(model_path, prompts[:k], args.output_len, dtype, 1) * args.num_requests / k
        rows.append(("transformers, one at a time" + (f" (timed {k}, scaled)" if k != args.num_requests else ""),
                     t, t / elapsed))
    if args.baseline in ("static", "both"):
        t = run_hf_baseline(model_path, prompts, args.output_len, dtype, args.static_batch)
        rows.append((f"transformers, static batches of {args.static_batch}", t, t / elapsed))

    print(f"\n{args.num_requests} requests x {args.input_len} in x {args.output_len} out, "
          f"dtype {str(dtype).removeprefix('torch.')}, threads {torch.get_num_threads()}, cores {os.cpu_count()}")
    print(f"{'engine':45s} {'time s':>9s} {'req/s':>8s} {'in tok/s':>9s} {'out tok/s':>9s} {'tessera x':>9s}")
    for name, t, ratio in rows:
        print(f"{name:45s} {t:9.2f} {args.num_requests / t:8.3f} {n_in / t:9.1f} {n_out / t:9.1f} {ratio:9.2f}")
    print("\ndecode step breakdown (torch profiler; kernel = matmuls + attention)")
    print(f"{'batch':>5s} {'ctx':>5s} {'step ms':>8s} {'kernel ms':>9s} {'overhead ms':>11s} {'overhead':>8s}")
    for b in breakdown:
        print(f"{b['batch']:5d} {b['context']:5d} {b['step_ms_profiled']:8.1f} {b['kernel_ms']:9.1f} "
              f"{b['overhead_ms']:11.1f} {100 * b['overhead_frac']:7.1f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "dtype": str(dtype),
        "results": [{"engine": n, "seconds": t, "speedup_of_tessera": r} for n, t, r in rows],
        "decode_breakdown": breakdown,
    }, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
