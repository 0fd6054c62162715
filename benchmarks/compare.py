"""Tessera next to the engines a user would pick instead, on this machine, same model, same work.

Each engine runs in a process of its own (its own venv for vLLM and llama.cpp; see
benchmarks/competitors/setup.sh), with the same thread count, on the same workloads:

(a) offline throughput: N requests of random token ids (benchmarks/throughput.py's make_prompts,
    seed 0), input_len prompt tokens, exactly output_len generated (ignore_eos), greedy;
(b) single stream: one input_len-token request alone; TTFT (a 1-token request) and decode tok/s
    ((output_len - 1) / (time of an output_len request - TTFT)), medians of --single-reps, every
    request with a prompt of its own (seed 1) so no prefix cache helps.

Engines that are not installed are listed as missing; one that fails records its error. Prints a
table and writes JSON; --engines runs a subset and keeps the other engines' earlier entries.

    /tmp/tools/quiet .venv/bin/python benchmarks/compare.py --engines tessera-f32,tessera-gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNERS = HERE / "competitors"
sys.path.insert(0, str(HERE))

from throughput import make_prompts  # noqa: E402  (benchmarks/ is not a package)

COMPETITORS = Path(os.environ.get("TESSERA_COMPETITORS", "/work/competitors"))


@dataclass(frozen=True)
class Engine:
    name: str
    python: str  # interpreter of the venv it runs in
    runner: str  # script under benchmarks/competitors/
    args: tuple[str, ...]
    weights: str  # what precision the weights are computed in, in words


def engines(args) -> dict[str, Engine]:
    me = sys.executable
    vllm_py = str(COMPETITORS / "vllm" / "bin" / "python")
    llama_py = str(COMPETITORS / "llamacpp" / "bin" / "python")
    return {e.name: e for e in [
        Engine("tessera-f32", me, "run_tessera.py", ("--quantization", "none"),
               "float32 (Q4_1 dequantized at load), fp32 KV"),
        Engine("tessera-gguf", me, "run_tessera.py", ("--quantization", "gguf"),
               "Q4_1 blocks kept (--quantization gguf), fp32 KV"),
        Engine("tessera-gguf-head", me, "run_tessera.py", ("--quantization", "gguf", "--quantize-lm-head"),
               "Q4_1 blocks kept, tied lm_head from the file's Q8_0 too (as llama.cpp), fp32 KV"),
        Engine("transformers", me, "run_transformers.py", (),
               "float32 (Q4_1 dequantized by transformers), static batches of 8"),
        Engine("vllm", vllm_py, "run_vllm.py", (), "float32 safetensors (Q4_1 dequantized), fp32 KV"),
        Engine("vllm-1proc", vllm_py, "run_vllm.py", ("--single-process",),
               "as vllm, engine core and worker in one process"),
        Engine("llamacpp-q4_1", llama_py, "run_llamacpp.py", ("--gguf", args.gguf, "--kv-type", "f16"),
               "Q4_1 GGUF (same file), f16 KV (llama.cpp default)"),
        Engine("llamacpp-f32", llama_py, "run_llamacpp.py", ("--gguf", args.f32_gguf, "--kv-type", "f32"),
               "F32 GGUF (Q4_1 dequantized by llama-quantize), f32 KV"),
    ]}


DEFAULT_ENGINES = "tessera-f32,tessera-gguf,transformers,vllm,llamacpp-q4_1,llamacpp-f32"


def missing_reason(e: Engine, args) -> str | None:
    if not Path(e.python).exists():
        return f"{e.python} not found: create the venv with benchmarks/competitors/setup.sh"
    if e.name.startswith("vllm") and not (Path(args.hf_folder) / "config.json").is_file():
        return f"no transformers folder at {args.hf_folder}: run benchmarks/competitors/make_hf_folder.py"
    if e.name == "llamacpp-f32" and not Path(args.f32_gguf).is_file():
        cmd = [e.python, str(RUNNERS / "convert_gguf.py"), args.gguf, args.f32_gguf, "--type", "f32"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return f"could not write the F32 GGUF: {(r.stdout + r.stderr)[-500:]}"
    return None


def env_for(e: Engine, threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if e.name.startswith("vllm"):
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    return env


def run_engine(e: Engine, workload: Path, args) -> dict:
    out = Path(tempfile.mkstemp(prefix=f"compare-{e.name}-", suffix=".json")[1])
    cmd = [e.python, str(RUNNERS / e.runner), "--workload", str(workload), "--out", str(out), *e.args]
    print(f"--- {e.name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env_for(e, args.threads), capture_output=True, text=True, timeout=args.timeout)
        rc, log = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as exc:
        rc, log = "timeout", f"killed after {args.timeout} s\n" + str(exc.stdout or "")[-2000:]
    result = json.loads(out.read_text()) if out.stat().st_size else {}
    out.unlink()
    if rc != 0 or not result.get("ok"):
        result.update(ok=False, returncode=rc, log_tail=log[-3000:])
        result.setdefault("error", log.strip().splitlines()[-1] if log.strip() else f"exit {rc}")
        print(f"    failed: {result['error']}", flush=True)
    result.update(engine=e.name, weights=e.weights, wall_s=time.perf_counter() - t0,
                  measured_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    return result


def vocab_size(gguf_path: str) -> int:
    from gguf import GGUFReader

    return len(GGUFReader(gguf_path).fields["tokenizer.ggml.tokens"].data)


def leading_agreement(results: dict[str, dict]) -> None:
    """How many leading greedy tokens of request 0 each engine shares with tessera-f32: a check
    that every engine did the same work (near-ties in the logits may part them later)."""
    ref = results.get("tessera-f32", {}).get("throughput", {}).get("first_request_tokens")
    for r in results.values():
        toks = r.get("throughput", {}).get("first_request_tokens") if r.get("ok") else None
        if ref and toks:
            r["throughput"]["leading_tokens_equal_to_tessera_f32"] = next(
                (i for i, (a, b) in enumerate(zip(ref, toks, strict=False)) if a != b), min(len(ref), len(toks)))


def print_table(results: dict[str, dict], args) -> None:
    base = results.get("tessera-f32", {})
    print(f"\n(a) {args.num_requests} requests x {args.input_len} in x {args.output_len} out; "
          f"(b) one {args.input_len}-token request, {args.output_len} out; {args.threads} threads, "
          f"{os.cpu_count()} cores")
    head = (f"{'engine':15s} {'(a) s':>7s} {'out tok/s':>9s} {'vs tessera':>10s} {'prefill s':>9s} {'(b) TTFT ms':>11s} "
            f"{'decode tok/s':>12s} {'same':>4s}  weights")
    print(head)
    for name, r in results.items():
        if not r.get("ok"):
            print(f"{name:15s} {'-':>7s} {'-':>9s} {'-':>10s} {'-':>9s} {'-':>11s} {'-':>12s} {'-':>4s}  "
                  f"not run: {r.get('error', '?')[:90]}")
            continue
        t, s = r["throughput"], r["single"]
        rel = (f"{base['throughput']['seconds'] / t['seconds']:9.2f}x" if base.get("ok") else f"{'-':>10s}")
        same = t.get("leading_tokens_equal_to_tessera_f32", "-")
        pre = f"{t['prefill_only_s']:9.1f}" if "prefill_only_s" in t else f"{'-':>9s}"
        print(f"{name:15s} {t['seconds']:7.1f} {t['out_tok_s']:9.1f} {rel} {pre} {1000 * s['ttft_s']:11.0f} "
              f"{s['decode_tok_s']:12.1f} {same:>4}  {r['weights']}")
    print("(vs tessera: the engine's throughput over tessera-f32's; > 1 means faster than Tessera. "
          "prefill s: (a') the same number of prompts, 1 token each; "
          "same: leading greedy tokens of request 0 equal to tessera-f32's)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=DEFAULT_ENGINES,
                    help=f"comma-separated, from: tessera-f32, tessera-gguf, tessera-gguf-head, transformers, vllm, vllm-1proc, "
                         f"llamacpp-q4_1, llamacpp-f32 (default {DEFAULT_ENGINES})")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", default=None, help="the Q4_1 GGUF (default: the default model's cached file)")
    ap.add_argument("--f32-gguf", default=str(COMPETITORS / "models" / "smollm2-135m-f32.gguf"))
    ap.add_argument("--hf-folder", default=str(COMPETITORS / "models" / "smollm2-135m-f32"))
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per engine before it is killed")
    ap.add_argument("--out", default=str(HERE / "results" / "compare.json"))
    args = ap.parse_args()
    if args.gguf is None:
        from tessera.config import DEFAULT_MODEL
        from tessera.model.download import resolve_model_path

        args.gguf = str(resolve_model_path(DEFAULT_MODEL))

    known = engines(args)
    chosen = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = set(chosen) - set(known)
    if unknown:
        sys.exit(f"unknown engine(s) {sorted(unknown)}; known: {', '.join(known)}")

    vocab = vocab_size(args.gguf)
    workload = {
        "threads": args.threads, "input_len": args.input_len, "output_len": args.output_len,
        "single_reps": args.single_reps, "gguf_q4_1": args.gguf, "hf_folder": args.hf_folder,
        "throughput_prompts": make_prompts(args.num_requests, args.input_len, vocab, seed=0),
        "single_prompts": make_prompts(2 * args.single_reps + 1, args.input_len, vocab, seed=1),
        # (a)'s prefill alone, timed on fresh prompts so that no prefix cache serves them
        "prefill_prompts": make_prompts(args.num_requests, args.input_len, vocab, seed=2),
    }
    out_path = Path(args.out)
    previous = json.loads(out_path.read_text()) if out_path.is_file() else {}
    same_work = previous.get("workload") == {k: v for k, v in workload.items() if not k.endswith("prompts")}
    results: dict[str, dict] = dict(previous.get("results", {})) if same_work else {}

    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="compare-workload-") as f:
        json.dump(workload, f)
        f.flush()
        for name in chosen:
            e = known[name]
            reason = missing_reason(e, args)
            if reason:
                print(f"--- {name}: missing ({reason})")
                results[name] = {"engine": name, "weights": e.weights, "ok": False, "error": f"missing: {reason}"}
                continue
            results[name] = run_engine(e, Path(f.name), args)

    order = list(known)
    results = {k: results[k] for k in sorted(results, key=order.index)}
    leading_agreement(results)
    print_table(results, args)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "workload": {k: v for k, v in workload.items() if not k.endswith("prompts")},
        "machine": {"cpus": os.cpu_count(), "cpu": _cpu_name()},
        "results": results,
    }, indent=2))
    print(f"\nwrote {out_path}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    main()
