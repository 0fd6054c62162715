"""Tessera next to the engines a user would pick instead, on this machine, same model, same work.

Each engine runs in a process of its own (its own venv for vLLM and llama.cpp; see
benchmarks/competitors/setup.sh), with the same thread count, in the same dtype (--dtype auto:
bfloat16 where the CPU has native bf16, else float32), on the same workloads:

(a) offline throughput: N requests of random token ids (benchmarks/throughput.py's make_prompts,
    seed 0), input_len prompt tokens, exactly output_len generated (ignore_eos), greedy;
(b) single stream: one input_len-token request alone; TTFT (a 1-token request) and decode tok/s
    ((output_len - 1) / (time of an output_len request - TTFT)), medians of --single-reps, every
    request with a prompt of its own (seed 1) so no prefix cache helps.

Every figure is printed next to its floor on this machine (benchmarks/compare_floors.py: the
roofline of benchmarks/roofline.py with the GEMM rate and bandwidth measured at the start of the
run). --model picks the model: the default (SmolLM2-135M, Q4_1 GGUF) or `gemma-3-270m` (Q4_K_M);
the GGUF engines read that same file. Engines that are not installed are listed as missing; one
that fails records its error. Prints a table and writes JSON; --engines runs a subset and keeps the
other engines' earlier entries (so a long comparison runs as several short locked runs).

--rounds N runs the engines N times, in reverse order every other round (a shared VM's speed
drifts by 5-10% within minutes: one run each can put either engine ahead of where a second run
would): each engine's figures are then those of its median offline run (with --parts single, its
median single-stream decode run), and a table lists every round's offline out tok/s and
single-stream decode tok/s, and the Tessera engine's ratio to each other engine in that round,
with the medians (tessera, or tessera-gguf where tessera did not run: next to llama-bench).

    /tmp/tools/quiet .venv/bin/python benchmarks/compare.py --engines tessera,tessera-gguf
    /tmp/tools/quiet .venv/bin/python benchmarks/compare.py --model gemma-3-270m --engines tessera-gguf,llamacpp-gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNERS = HERE / "competitors"
sys.path.insert(0, str(HERE))

from machine import cpu_name  # noqa: E402
from throughput import make_prompts  # noqa: E402  (benchmarks/ is not a package)

COMPETITORS = Path(os.environ.get("TESSERA_COMPETITORS", "/work/competitors"))
VLLM_PYTHON = COMPETITORS / "vllm" / "bin" / "python"


@dataclass(frozen=True)
class Engine:
    name: str
    python: str  # interpreter of the venv it runs in
    runner: str  # script under benchmarks/competitors/
    args: tuple[str, ...]
    weights: str  # what precision the weights are computed in, in words


def engines(args) -> dict[str, Engine]:
    me = sys.executable
    vllm_py = str(VLLM_PYTHON)
    llama_py = str(COMPETITORS / "llamacpp" / "bin" / "python")
    dt, q = args.dtype, args.gguf_type
    return {e.name: e for e in [
        Engine("tessera", me, "run_tessera.py", ("--quantization", "none", "--dtype", dt),
               f"{dt} ({q} dequantized at load; bf16 steps of up to 32 rows read the {q} blocks on AMX CPUs, of up "
               f"to 8 on other AVX-512 BF16 ones (a Q8_0 lm_head up to 4), float32 steps of up to 8 on AVX2 ones, "
               f"same bits), {dt} KV"),
        Engine("tessera-eager", me, "run_tessera.py", ("--quantization", "none", "--dtype", dt, "--enforce-eager"),
               f"{dt} as tessera, --enforce-eager (the module path, no native decoder stack)"),
        Engine("tessera-gguf", me, "run_tessera.py", ("--quantization", "gguf", "--dtype", dt),
               f"{q} blocks kept (--quantization gguf), {dt} activations and KV"),
        Engine("transformers", me, "run_transformers.py", ("--dtype", dt, "--static-batch", str(args.num_requests)),
               f"{dt} ({q} dequantized by transformers), one static batch of {args.num_requests}"),
        Engine("vllm", vllm_py, "run_vllm.py", ("--dtype", dt),
               f"{dt} (safetensors of the {q} file dequantized), {dt} KV, both cores bound, tcmalloc + libiomp5"),
        Engine("vllm-1proc", vllm_py, "run_vllm.py", ("--dtype", dt, "--single-process"),
               "as vllm, engine core and worker in one process"),
        Engine("llamacpp-gguf", llama_py, "run_llamacpp.py", ("--gguf", args.gguf, "--kv-type", "f16"),
               f"{q} GGUF (the same file), f16 KV (llama.cpp default)"),
        Engine("llamacpp-float", llama_py, "run_llamacpp.py",
               ("--gguf", args.float_gguf, "--kv-type", "f16" if dt == "bfloat16" else "f32"),
               f"{_gguf_float(dt).upper()} GGUF ({q} dequantized by llama-quantize), "
               f"{'f16' if dt == 'bfloat16' else 'f32'} KV"),
        Engine("llama-bench", llama_py, "run_llamabench.py", ("--gguf", args.gguf, "--bench", str(LLAMA_BENCH)),
               f"{q} GGUF (the same file), llama.cpp's own llama-bench (single stream only)"),
    ]}


LLAMA_BENCH = COMPETITORS / "llamacpp-build" / "bin" / "llama-bench"
DEFAULT_ENGINES = "tessera,tessera-gguf,transformers,vllm,llamacpp-gguf,llamacpp-float,llama-bench"
GEMMA_ENGINES = "tessera,tessera-gguf,llamacpp-gguf,llama-bench"


def _gguf_float(dtype: str) -> str:
    return "bf16" if dtype == "bfloat16" else "f32"


def missing_reason(e: Engine, args) -> str | None:
    if not Path(e.python).exists():
        return f"{e.python} not found: create the venv with benchmarks/competitors/setup.sh"
    if e.name.startswith("vllm") and not (Path(args.hf_folder) / "config.json").is_file():
        return f"no transformers folder at {args.hf_folder}: run benchmarks/competitors/make_hf_folder.py"
    if e.name == "llama-bench" and not LLAMA_BENCH.is_file():
        return f"{LLAMA_BENCH} not built: benchmarks/competitors/setup.sh llamacpp"
    if e.name == "llamacpp-float" and not Path(args.float_gguf).is_file():
        cmd = [e.python, str(RUNNERS / "convert_gguf.py"), args.gguf, args.float_gguf, "--type", _gguf_float(args.dtype)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return f"could not write the float GGUF: {(r.stdout + r.stderr)[-500:]}"
    return None


def vllm_preload(python: str) -> str:
    """tcmalloc and Intel's OpenMP runtime, as vLLM's CPU guide preloads them (its best setting)."""
    libs = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), Path(python).parents[1] / "lib" / "libiomp5.so"]
    return ":".join(str(p) for p in libs if p.is_file())


def env_for(engine: str, threads: int) -> dict[str, str]:
    """The environment an engine's process runs in (by engine name; serve_compare.py's servers too)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if engine.startswith("vllm"):
        # Its default binds the model to one core and keeps the other for the front end.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
        if preload := vllm_preload(str(VLLM_PYTHON)):
            env["LD_PRELOAD"] = preload
    return env


def run_engine(e: Engine, workload: Path, args) -> dict:
    out = Path(tempfile.mkstemp(prefix=f"compare-{e.name}-", suffix=".json")[1])
    cmd = [e.python, str(RUNNERS / e.runner), "--workload", str(workload), "--out", str(out), *e.args]
    print(f"--- {e.name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env_for(e.name, args.threads), capture_output=True, text=True, timeout=args.timeout)
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


def leading_agreement(results: dict[str, dict]) -> None:
    """How many leading greedy tokens of request 0 each engine shares with tessera: a check that
    every engine did the same work (near-ties in the logits part them sooner in bf16 or 4-bit)."""
    ref = results.get("tessera", {}).get("throughput", {}).get("first_request_tokens")
    for r in results.values():
        toks = r.get("throughput", {}).get("first_request_tokens") if r.get("ok") else None
        if ref and toks:
            r["throughput"]["leading_tokens_equal_to_tessera"] = next(
                (i for i, (a, b) in enumerate(zip(ref, toks, strict=False)) if a != b), min(len(ref), len(toks)))


def add_floors(results: dict[str, dict], args, cfg) -> None:
    """Each engine's floors (compare_floors.py) on the machine figures measured in its run."""
    from compare_floors import bf16_codes_saving, f32_blocks_saving, floors, gguf_weight_bytes
    from roofline import count_step

    elem = 2 if args.dtype == "bfloat16" else 4
    q_bytes = gguf_weight_bytes(args.gguf)
    # Tessera decodes a GGUF model's layers from their blocks (bf16 on AMX, float32 at batch 1 on
    # AVX2): its floors count the bytes it reads.
    float_bytes = count_step(cfg, 1, [(1, 1)], 1, elem, elem)["weight_bytes"]
    saving = bf16_codes_saving(args.gguf) if elem == 2 else 0
    codes_bytes = float_bytes - saving if saving else None
    b1_saving = f32_blocks_saving(args.gguf) if elem == 4 else 0
    b1_bytes = float_bytes - b1_saving if b1_saving else None
    for name, r in results.items():
        if r.get("ok") and "machine" in r:
            quantized = name in ("tessera-gguf", "llamacpp-gguf", "llama-bench")
            tessera = name.startswith("tessera") and not quantized
            own = q_bytes if quantized else codes_bytes if tessera else None
            r["floors"] = floors(cfg, r["machine"], args.input_len, args.output_len, args.num_requests, elem, own,
                                 b1_bytes if tessera else None)


def _x(measured: float | None, floor: float) -> str:
    return f"{measured * 1e3:8.1f} {floor * 1e3:7.1f} {measured / floor:5.1f}x" if measured else f"{'-':>8s} {'-':>7s} {'-':>6s}"


def print_table(results: dict[str, dict], args) -> None:
    base = results.get("tessera", {})
    print(f"\n{args.model}, --dtype {args.dtype}; (a) {args.num_requests} requests x {args.input_len} in x "
          f"{args.output_len} out; (b) one {args.input_len}-token request, {args.output_len} out; "
          f"{args.threads} threads, {os.cpu_count()} cores, {cpu_name()}")
    head = (f"{'engine':15s} {'(a) s':>7s} {'out tok/s':>9s} {'vs tessera':>10s} {'prefill s':>9s} {'(b) TTFT ms':>11s} "
            f"{'decode tok/s':>12s} {'same':>4s}  weights")
    print(head)
    for name, r in results.items():
        if not r.get("ok"):
            print(f"{name:15s} {'-':>7s} {'-':>9s} {'-':>10s} {'-':>9s} {'-':>11s} {'-':>12s} {'-':>4s}  "
                  f"not run: {r.get('error', '?')[:90]}")
            continue
        t, s = r.get("throughput"), r.get("single", {})
        if t:
            rel = (f"{base['throughput']['seconds'] / t['seconds']:9.2f}x" if base.get("ok") else f"{'-':>10s}")
            pre = f"{t['prefill_only_s']:9.1f}" if "prefill_only_s" in t else f"{'-':>9s}"
            a = f"{t['seconds']:7.1f} {t['out_tok_s']:9.1f} {rel} {pre}"
        else:
            a = f"{'-':>7s} {'-':>9s} {'-':>10s} {'-':>9s}"
        same = t.get("leading_tokens_equal_to_tessera", "-") if t else "-"
        b = f"{1000 * s['ttft_s']:11.0f} {s['decode_tok_s']:12.1f}" if s else f"{'-':>11s} {'-':>12s}"
        print(f"{name:15s} {a} {b} {same:>4}  {r['weights']}")
    print("(vs tessera: tessera's offline time over the engine's; > 1 means faster than Tessera. "
          "prefill s: (a') the same number of fresh prompts, 1 token each; "
          "same: leading greedy tokens of request 0 equal to tessera's)")

    print("\nfloors (benchmarks/compare_floors.py): measured ms, floor ms, measured / floor")
    print(f"{'engine':15s} {'decode b1 ms/token':>22s} {'decode b' + str(args.num_requests) + ' step ms':>22s} "
          f"{'TTFT (prefill) ms':>22s} {'GEMM %':>6s} {'(a) offline ms':>24s}  roofs")
    for name, r in results.items():
        f = r.get("floors")
        if not f:
            continue
        t, s, m = r.get("throughput"), r.get("single"), r["machine"]
        step = (t["seconds"] - t["prefill_only_s"]) / (args.output_len - 1) if t and "prefill_only_s" in t else None
        gemm = f"{f['prefill_flops'] / s['ttft_s'] / m['gemm_flops']:6.0%}" if s else f"{'-':>6s}"
        print(f"{name:15s} {_x(1 / s['decode_tok_s'] if s else None, f['decode_b1_s'])} {_x(step, f['decode_b_s'])} "
              f"{_x(s['ttft_s'] if s else None, f['prefill_s'])} {gemm} "
              f"{_x(t['seconds'] if t else None, f['offline_s']):>24s}  "
              f"{m['gemm_dtype']} GEMM {m['gemm_flops'] / 1e12:.2f} TFLOP/s, {m['bandwidth'] / 1e9:.1f} GB/s")
    print(f"(decode b1: 1 / single-stream tok/s against weight + KV bytes / bandwidth; decode b{args.num_requests} step: "
          f"((a) - (a')) / {args.output_len - 1} against max(bytes / bandwidth, FLOPs / GEMM rate); TTFT against the "
          f"prefill's FLOPs / GEMM rate, GEMM %: the share of the rate it reaches; (a) against all prefills at the GEMM "
          f"rate + {args.output_len - 1} decode steps at their floors)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="the default model's name (the default), gemma-3-270m, or a .gguf file")
    ap.add_argument("--engines", default=None,
                    help=f"comma-separated, from: tessera, tessera-gguf, transformers, vllm, vllm-1proc, llamacpp-gguf, "
                         f"llamacpp-float, llama-bench (default {DEFAULT_ENGINES}; for gemma-3-270m {GEMMA_ENGINES})")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 where the CPU has native bf16), bfloat16, float32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="throughput,single",
                    help="which of (a) throughput and (b) single to run now; the other keeps its earlier figures")
    ap.add_argument("--float-gguf", default=None, help="the float GGUF for llamacpp-float "
                    "(default: $TESSERA_COMPETITORS/models/<model>-<bf16|f32>.gguf, written on first use)")
    ap.add_argument("--hf-folder", default=None, help="the transformers folder vLLM loads "
                    "(default: $TESSERA_COMPETITORS/models/<model>-f32, from make_hf_folder.py)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per engine before it is killed")
    ap.add_argument("--rounds", type=int, default=1, help="run the engines this many times, alternating their "
                    "order; each engine's figures are its median offline run's (see above)")
    ap.add_argument("--out", default=None, help="default: results/compare.json (default model), "
                    "results/compare_<model>.json otherwise")
    args = ap.parse_args()

    import torch
    from compare_floors import measure_machine

    from tessera.config import DEFAULT_MODEL, resolve_dtype
    from tessera.model.download import resolve_model_path
    from tessera.model.gguf_loader import GGUFModelFiles

    args.model = args.model or DEFAULT_MODEL
    args.dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    args.gguf = str(resolve_model_path(args.model))
    files = GGUFModelFiles(Path(args.gguf))
    args.gguf_type = _gguf_type(files)
    stem = "smollm2-135m" if args.model == DEFAULT_MODEL else Path(args.gguf).stem.lower()
    args.float_gguf = args.float_gguf or str(COMPETITORS / "models" / f"{stem}-{_gguf_float(args.dtype)}.gguf")
    args.hf_folder = args.hf_folder or str(COMPETITORS / "models" / f"{stem}-f32")
    args.engines = args.engines or (DEFAULT_ENGINES if args.model == DEFAULT_MODEL else GEMMA_ENGINES)
    default_out = "compare.json" if args.model == DEFAULT_MODEL else f"compare_{stem}.json"
    out_path = Path(args.out or HERE / "results" / default_out)

    known = engines(args)
    chosen = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = set(chosen) - set(known)
    if unknown:
        sys.exit(f"unknown engine(s) {sorted(unknown)}; known: {', '.join(known)}")

    vocab = files.config.vocab_size
    workload = {
        "model": args.model, "dtype": args.dtype,
        "threads": args.threads, "input_len": args.input_len, "output_len": args.output_len,
        "single_reps": args.single_reps, "gguf_q4_1": args.gguf, "hf_folder": args.hf_folder,
        "throughput_prompts": make_prompts(args.num_requests, args.input_len, vocab, seed=0),
        "single_prompts": make_prompts(2 * args.single_reps + 1, args.input_len, vocab, seed=1),
        # (a)'s prefill alone, timed on fresh prompts so that no prefix cache serves them
        "prefill_prompts": make_prompts(args.num_requests, args.input_len, vocab, seed=2),
        "parts": [p.strip() for p in args.parts.split(",") if p.strip()],
    }
    previous = json.loads(out_path.read_text()) if out_path.is_file() else {}
    same_work = previous.get("workload") == _described(workload)
    results: dict[str, dict] = dict(previous.get("results", {})) if same_work else {}

    # The roofs of this run's floors, measured now, before any engine loads.
    machine = measure_machine(getattr(torch, args.dtype), args.threads)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; {machine['gemm_dtype']} GEMM 2048^3 "
          f"{machine['gemm_flops'] / 1e12:.2f} TFLOP/s, copy {machine['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"sum {machine['read_bytes_per_s'] / 1e9:.1f} GB/s ({args.threads} threads)", flush=True)
    if args.rounds < 1:
        sys.exit("--rounds must be >= 1")
    runs: dict[str, list[dict]] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="compare-workload-") as f:
        json.dump(workload, f)
        f.flush()
        present = []
        for name in chosen:
            e = known[name]
            reason = missing_reason(e, args)
            if reason:
                print(f"--- {name}: missing ({reason})")
                results[name] = {"engine": name, "weights": e.weights, "ok": False, "error": f"missing: {reason}"}
            else:
                present.append(name)
        for rnd in range(args.rounds):
            for name in present if rnd % 2 == 0 else present[::-1]:
                runs.setdefault(name, []).append(run_engine(known[name], Path(f.name), args))
        for name, done in runs.items():
            new = median_run(done)
            new["machine"] = machine
            if args.rounds > 1:
                new["rounds"] = [_round_summary(r) for r in done]
            old = results.get(name, {})
            if new.get("ok") and old.get("ok"):  # the part not run now keeps its earlier figures
                for part in ("throughput", "single"):
                    if part not in new and part in old:
                        new[part] = old[part]
                        new[f"{part}_measured_at"] = old.get(f"{part}_measured_at", old.get("measured_at"))
            for part in workload["parts"]:
                new[f"{part}_measured_at"] = new["measured_at"]
            results[name] = new

    order = list(known)
    results = {k: results[k] for k in sorted(results, key=order.index)}
    leading_agreement(results)
    add_floors(results, args, files.config)
    print_table(results, args)
    if args.rounds > 1:
        print_rounds(runs, chosen)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "workload": _described(workload),
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_name(), "flags": _cpu_flags()},
        "results": results,
    }, indent=2))
    print(f"\nwrote {out_path}")


def _throughput(run: dict) -> dict:
    """A run's offline figures ({} when it failed or ran only the single-stream part)."""
    return run.get("throughput", {}) if run.get("ok") else {}


def _offline_s(run: dict) -> float | None:
    return _throughput(run).get("seconds")


def _decode_tok_s(run: dict) -> float | None:
    """A run's single-stream decode tok/s (None when it failed or ran only the offline part)."""
    return run.get("single", {}).get("decode_tok_s") if run.get("ok") else None


def median_run(done: list[dict]) -> dict:
    """The run whose offline time is the median of the engine's runs (the lower middle of an even
    count); without offline figures (--parts single), the run whose single-stream decode rate is
    the median; with neither (every run failed), the last run."""
    timed = sorted((r for r in done if _offline_s(r) is not None), key=_offline_s)
    if timed:
        return timed[(len(timed) - 1) // 2]
    streamed = sorted((r for r in done if _decode_tok_s(r) is not None), key=_decode_tok_s)
    return streamed[(len(streamed) - 1) // 2] if streamed else done[-1]


def _round_summary(run: dict) -> dict:
    t = _throughput(run)
    return {"ok": bool(run.get("ok")), "seconds": t.get("seconds"), "out_tok_s": t.get("out_tok_s"),
            "decode_tok_s": _decode_tok_s(run), "measured_at": run.get("measured_at")}


def print_rounds(runs: dict[str, list[dict]], chosen: list[str]) -> None:
    """Per round, each engine's offline out tok/s and single-stream decode tok/s (the parts that
    ran), and the Tessera engine's ratio to each other engine in the same round (both measured
    minutes apart, in alternating order), with the medians. The Tessera engine is tessera, else
    tessera-gguf (a --parts single comparison with llama-bench)."""
    names = [n for n in chosen if n in runs]
    base = next((n for n in ("tessera", "tessera-gguf") if n in runs), None)
    others = [n for n in names if n != base] if base else []
    for label, figure in (("offline out tok/s", lambda r: _throughput(r).get("out_tok_s")),
                          ("single-stream decode tok/s", _decode_tok_s)):
        def rate(name: str, i: int, figure=figure) -> float | None:  # engine `name`'s figure in round i
            return figure(runs[name][i]) if i < len(runs[name]) else None

        rounds = max(len(v) for v in runs.values())
        if not any(rate(n, i) for n in names for i in range(rounds)):
            continue  # the part did not run
        print(f"\n{label} per round" + (f" ({base} / engine in the same round)" if others else ""))
        print("round " + "".join(f"{n:>16s}" for n in names) + "".join(f"{'t/' + n:>16s}" for n in others))
        ratios: dict[str, list[float]] = {n: [] for n in others}
        for i in range(rounds):
            line = f"{i + 1:<6d}" + "".join(f"{rate(n, i):16.1f}" if rate(n, i) else f"{'-':>16s}" for n in names)
            for n in others:
                if rate(base, i) and rate(n, i):
                    ratios[n].append(rate(base, i) / rate(n, i))
                    line += f"{ratios[n][-1]:15.2f}x"
                else:
                    line += f"{'-':>16s}"
            print(line)
        if others:
            print("median" + " " * 16 * len(names) + "".join(
                f"{statistics.median(ratios[n]):15.2f}x" if ratios[n] else f"{'-':>16s}" for n in others))


def _described(workload: dict) -> dict:
    """The workload as the JSON records it (runs of the same one merge): without the prompts
    (they follow from the seeds) and the parts run this time."""
    return {k: v for k, v in workload.items() if not k.endswith("prompts") and k != "parts"}


def _gguf_type(files) -> str:
    """The file's quantization in llama.cpp's words (general.file_type), e.g. Q4_1 or Q4_K_M."""
    from gguf import LlamaFileType

    ft = files.reader.fields.get("general.file_type")
    if ft is None:
        return "GGUF"
    return LlamaFileType(int(ft.contents())).name.removeprefix("MOSTLY_")


def _cpu_flags() -> list[str]:
    """The flags that decide which kernels every engine can use here."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [f for f in wanted if f in flags.split()]


if __name__ == "__main__":
    main()
