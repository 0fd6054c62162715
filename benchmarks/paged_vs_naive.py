"""The seed documents' headline, measured here: PagedAttention with continuous batching against a
naive implementation on high-traffic, variable-length work (issue 15, "What must be shown").

Workload: --num-requests (200) requests, all there at once (offline), greedy, ignore_eos, prompt
and output lengths drawn (seed 0) from lognormal fits to ShareGPT, the conversation dataset vLLM's
paper and benchmarks use (ShareGPT_V3_unfiltered_cleaned_split). Parameters FROM MEMORY, not
fitted here (no dataset on this machine): the PagedAttention paper (Kwon et al., SOSP 2023, its
Fig. 11) gives ShareGPT means of 161.31 prompt and 337.99 output tokens; the spread sigma = 1.0 (log
space) for both is an assumption matching the heavy right tail of its histograms. mu = ln(mean) -
sigma^2 / 2, lengths rounded and clipped to [4, --max-input (1024)] and [4, --max-output (512)].
vLLM's own ShareGPT filter drops prompts over 1024 and prompt + output over 2048; the output clip
here is tighter so that the naive static batches (each decoded for its longest output) fit in
short locked runs on 2 cores: it shortens the tail, which favours the static batches. Prompt tokens are random ids
(benchmarks/throughput.py's make_prompts): with ignore_eos only the lengths matter.

Engines, same model (the default GGUF), same dtype (--dtype auto: bf16 where the CPU has it):
- tessera: LLM.generate on all requests, continuous batching over the paged KV cache;
- hf-1: transformers `generate`, one request at a time;
- hf-8, hf-32: transformers `generate` in static batches of 8 / 32 in arrival order, each batch
  left-padded to its longest prompt and decoded for its longest output (the naive server: a batch
  ends when its last request does); only each request's own output counts as useful tokens.

A run takes --requests START:END (a slice, in batch multiples for hf-8/hf-32) so that each locked
run stays short; slices merge in the JSON and the table sums them once they cover every request.
hf-1 can instead run --sample K requests (evenly spaced) and EXTRAPOLATE: a least-squares fit of
seconds = a + b * prompt_len + c * output_len over the sampled requests, summed over all of them;
the table marks such a figure "extrapolated".

    /tmp/tools/quiet .venv/bin/python benchmarks/paged_vs_naive.py --engines tessera
    /tmp/tools/quiet .venv/bin/python benchmarks/paged_vs_naive.py --engines hf-32 --requests 0:96
    /tmp/tools/quiet .venv/bin/python benchmarks/paged_vs_naive.py --engines hf-1 --sample 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import cpu_name  # noqa: E402
from throughput import make_prompts  # noqa: E402

SHAREGPT = {"prompt_mean": 161.31, "output_mean": 337.99, "sigma": 1.0,
            "source": "ShareGPT means from the PagedAttention paper (Kwon et al., SOSP 2023), from memory; "
                      "sigma assumed"}


def lognormal_lengths(n: int, mean: float, sigma: float, lo: int, hi: int, rng: np.random.Generator) -> list[int]:
    mu = math.log(mean) - sigma**2 / 2  # so that the (unclipped) mean is `mean`
    return [int(min(hi, max(lo, round(x)))) for x in rng.lognormal(mu, sigma, n)]


def workload(n: int, vocab: int, max_input: int, max_output: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(0)
    in_lens = lognormal_lengths(n, SHAREGPT["prompt_mean"], SHAREGPT["sigma"], 4, max_input, rng)
    out_lens = lognormal_lengths(n, SHAREGPT["output_mean"], SHAREGPT["sigma"], 4, max_output, rng)
    prompts = [make_prompts(1, m, vocab, seed=1000 + i)[0] for i, m in enumerate(in_lens)]
    return prompts, out_lens


def run_tessera(model: str, dtype: str, threads: int, prompts, out_lens, max_num_seqs: int) -> dict:
    from tessera import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, num_threads=threads, max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == out_lens
    return {"seconds": seconds, "computed_out_tokens": sum(out_lens), "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": 512}


def hf_model(model: str, dtype: str):
    from transformers import AutoModelForCausalLM

    from tessera.model.download import resolve_model_path

    gguf = resolve_model_path(model)
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)).eval()


def hf_batch(hf, prompts: list[list[int]], n_out: int) -> None:
    """One static batch: left-padded to its longest prompt, decoded for n_out tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                          pad_token_id=0)
    assert out.shape[1] == width + n_out


def run_hf_static(hf, batch: int, prompts, out_lens) -> dict:
    hf_batch(hf, [prompts[0][:8]], 2)  # warm-up
    seconds, computed, per_batch = 0.0, 0, []
    for i in range(0, len(prompts), batch):
        ps, ns = prompts[i : i + batch], out_lens[i : i + batch]
        t0 = time.perf_counter()
        hf_batch(hf, ps, max(ns))
        per_batch.append(time.perf_counter() - t0)
        seconds += per_batch[-1]
        computed += len(ps) * max(ns)
    return {"seconds": seconds, "computed_out_tokens": computed, "batch_seconds": per_batch}


def run_hf_one(hf, prompts, out_lens, idx: list[int]) -> dict:
    hf_batch(hf, [prompts[0][:8]], 2)  # warm-up
    times = []
    for i in idx:
        t0 = time.perf_counter()
        hf_batch(hf, [prompts[i]], out_lens[i])
        times.append(time.perf_counter() - t0)
    return {"seconds": sum(times), "computed_out_tokens": sum(out_lens[i] for i in idx), "request_seconds": times}


def extrapolate(entry: dict, prompts, out_lens) -> dict:
    """hf-1 on a sample: fit seconds = a + b * prompt + c * output, predict every request."""
    idx = entry["indices"]
    x = np.array([[1.0, len(prompts[i]), out_lens[i]] for i in idx])
    coef, *_ = np.linalg.lstsq(x, np.array(entry["request_seconds"]), rcond=None)
    total = float(sum(coef @ np.array([1.0, len(p), n]) for p, n in zip(prompts, out_lens, strict=True)))
    return {"seconds": total, "fit_s": [float(c) for c in coef], "sampled": len(idx)}


def summarize(results: dict, prompts, out_lens) -> dict[str, dict]:
    """Per engine: seconds over all requests (slices summed once they cover them), or None."""
    n, useful = len(prompts), sum(out_lens)
    table = {}
    for engine, runs in results.items():
        covered = sorted(i for r in runs.values() if "indices" not in r for i in range(*r["slice"]))
        if covered == list(range(n)):
            done = [r for r in runs.values() if "indices" not in r]
            table[engine] = {"seconds": sum(r["seconds"] for r in done), "how": "measured",
                             "computed_out_tokens": sum(r["computed_out_tokens"] for r in done)}
        elif engine == "hf-1" and (sampled := [r for r in runs.values() if "indices" in r]):
            e = extrapolate(max(sampled, key=lambda r: len(r["indices"])), prompts, out_lens)
            table[engine] = {"seconds": e["seconds"], "how": f"extrapolated from {e['sampled']} requests",
                             "computed_out_tokens": useful, "fit_s": e["fit_s"]}
        else:
            table[engine] = {"seconds": None, "how": f"{len(set(covered))} of {n} requests run"}
        if table[engine]["seconds"]:
            table[engine]["useful_out_tok_s"] = useful / table[engine]["seconds"]
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="tessera", help="comma-separated: tessera, hf-1, hf-8, hf-32")
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="Tessera's --max-num-seqs")
    ap.add_argument("--requests", default=None, help="START:END, the slice of requests to run now (default all)")
    ap.add_argument("--sample", type=int, default=None, help="hf-1 only: run K evenly spaced requests, extrapolate")
    ap.add_argument("--out", default=str(HERE / "results" / "paged_vs_naive.json"))
    args = ap.parse_args()

    from tessera.config import DEFAULT_MODEL, resolve_dtype
    from tessera.model.download import resolve_model_path
    from tessera.model.gguf_loader import GGUFModelFiles

    model = args.model or DEFAULT_MODEL
    dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    torch.set_num_threads(args.threads)
    vocab = GGUFModelFiles(resolve_model_path(model)).config.vocab_size
    prompts, out_lens = workload(args.num_requests, vocab, args.max_input, args.max_output)
    start, end = (int(x) for x in args.requests.split(":")) if args.requests else (0, args.num_requests)
    described = {"model": model, "dtype": dtype, "threads": args.threads, "num_requests": args.num_requests,
                 "max_input": args.max_input, "max_output": args.max_output, "lengths": SHAREGPT,
                 "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": sum(out_lens),
                 "prompt_len_mean": float(np.mean([len(p) for p in prompts])),
                 "output_len_mean": float(np.mean(out_lens)),
                 "prompt_len_p50_p99": [float(np.percentile([len(p) for p in prompts], q)) for q in (50, 99)],
                 "output_len_p50_p99": [float(np.percentile(out_lens, q)) for q in (50, 99)]}
    out_path = Path(args.out)
    previous = json.loads(out_path.read_text()) if out_path.is_file() else {}
    results = previous.get("results", {}) if previous.get("workload") == described else {}

    ps, ns = prompts[start:end], out_lens[start:end]
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        print(f"--- {engine}: requests {start}:{end}" + (f", sample {args.sample}" if args.sample else ""), flush=True)
        if engine == "tessera":
            r = run_tessera(model, dtype, args.threads, ps, ns, args.max_num_seqs)
        elif engine in ("hf-8", "hf-32"):
            r = run_hf_static(hf_model(model, dtype), int(engine.split("-")[1]), ps, ns)
        elif engine == "hf-1":
            idx = (list(np.linspace(start, end - 1, args.sample).round().astype(int)) if args.sample
                   else list(range(start, end)))
            r = run_hf_one(hf_model(model, dtype), prompts, out_lens, [int(i) for i in idx])
            if args.sample:
                r["indices"] = [int(i) for i in idx]
        else:
            sys.exit(f"unknown engine {engine!r}: choose from tessera, hf-1, hf-8, hf-32")
        r.update(slice=[start, end], measured_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 load_average_1min=os.getloadavg()[0])
        key = f"{start}:{end}" + (f" sample {args.sample}" if "indices" in r else "")
        results.setdefault(engine, {})[key] = r
        print(f"    {r['seconds']:.1f} s for {len(ps) if 'indices' not in r else len(r['indices'])} requests", flush=True)

    table = summarize(results, prompts, out_lens)
    base = table.get("tessera", {}).get("seconds")
    print(f"\n{args.num_requests} requests, ShareGPT-like lengths (prompt mean {described['prompt_len_mean']:.0f}, "
          f"p50/p99 {described['prompt_len_p50_p99']}; output mean {described['output_len_mean']:.0f}, p50/p99 "
          f"{described['output_len_p50_p99']}), {dtype}, {args.threads} threads, {cpu_name()} "
          f"({os.cpu_count()} cores)")
    print(f"{'engine':8s} {'seconds':>9s} {'useful out tok/s':>16s} {'computed/useful':>15s} {'tessera is':>11s}  how")
    for engine, t in table.items():
        if not t["seconds"]:
            print(f"{engine:8s} {'-':>9s} {'-':>16s} {'-':>15s} {'-':>11s}  {t['how']}")
            continue
        rel = f"{t['seconds'] / base:10.1f}x" if base else f"{'-':>11s}"
        print(f"{engine:8s} {t['seconds']:9.1f} {t['useful_out_tok_s']:16.1f} "
              f"{t['computed_out_tokens'] / sum(out_lens):15.2f} {rel}  {t['how']}")
    print("(tessera is: the engine's time over Tessera's, i.e. how many times faster Tessera is; computed/useful: "
          "output tokens decoded (padding to the batch's longest output included) over those asked for)")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"workload": described, "machine": {"cpu": cpu_name(), "cpus": os.cpu_count()},
                                    "results": results, "summary": table}, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
