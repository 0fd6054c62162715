"""`tessera serve` against `vllm serve`, both measured by vLLM's own client (`vllm bench serve`).

One command, so both servers share a machine state: both start with their defaults (vLLM: both
cores bound, tcmalloc + libiomp5, compare.py's `env_for`) and stay up; at each request rate of
--rates, `vllm bench serve` (random dataset: --input-len-token prompts, exactly --output-len tokens
each with --ignore-eos, --num-prompts a run, the client's default sampling; the client on the same
cores) runs against one server and then the other, the first engine alternating, so a pair shares
the VM's speed of that minute. Every run has prompts of its own (seed = the run's index): with one
seed every run after the first would be served from the prefix cache (both engines cache by
default), which is how a "first-run penalty" shows up. After each rate-inf pair, Tessera's offline
engine (`LLM.generate`, a worker process loaded before the first run) does the same work on fresh
prompts: the reference for the server's own overhead. Prints output tokens/s, TTFT, TPOT and ITL
(mean, p99) per engine and run, Tessera over vLLM per pair, and writes JSON.

    /tmp/tools/quiet .venv/bin/python benchmarks/serve_compare.py --rates 2,4,8,inf,inf
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import COMPETITORS, VLLM_PYTHON, env_for  # noqa: E402  (benchmarks/ is not a package)
from machine import cpu_name  # noqa: E402

VLLM_CLI = HERE / "competitors" / "vllm_cli.py"
NAME = "smollm2"  # the served model name both servers answer to
METRICS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
           "p99_itl_ms")


def server_command(engine: str, port: int, args) -> tuple[list[str], dict[str, str]]:
    env = env_for(engine, args.threads)
    port = str(port)
    if engine.startswith("tessera"):
        cmd = [sys.executable, "-m", "tessera.cli", "serve", args.model, "--dtype", args.dtype, "--port", port,
               "--served-model-name", NAME, "--uvicorn-log-level", "warning"]
        if engine == "tessera-autopilot":  # the same server, its chunk budget sized to an ITL objective
            cmd += ["--autopilot", "--slo-itl-ms", str(args.slo_itl_ms)]
        return cmd, env
    return [str(VLLM_PYTHON), str(VLLM_CLI), "serve", args.hf_folder, "--dtype", args.dtype, "--port", port,
            "--served-model-name", NAME, "--max-model-len", "1024", "--seed", "0", "--uvicorn-log-level",
            "warning"], env


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health answered")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"/health did not answer within {timeout:.0f} s")


def bench(rate: str, seed: int, port: int, args, out_dir: Path) -> dict:
    name = f"rate_{seed}.json"
    cmd = [str(VLLM_PYTHON), str(VLLM_CLI), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", f"http://127.0.0.1:{port}", "--model", NAME, "--tokenizer", args.hf_folder,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--ignore-eos",
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    r = subprocess.run(cmd, env=env_for("client", args.threads), capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed at rate {rate}: {(r.stdout + r.stderr)[-1500:]}")
    return json.loads((out_dir / name).read_text())


@dataclass
class Server:
    engine: str
    port: int
    command: list[str]
    proc: subprocess.Popen
    log: Path
    startup_s: float = 0.0


def start(engine: str, port: int, args) -> Server:
    cmd, env = server_command(engine, port, args)
    print(f"--- {engine}: {' '.join(cmd)}", flush=True)
    log = Path(tempfile.mkstemp(prefix=f"serve-{engine}-", suffix=".log")[1])
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(engine, port, cmd, proc, log)
    try:
        server.startup_s = wait_healthy(proc, port, args.startup_timeout)
    except RuntimeError:
        stop(server)
        raise
    print(f"    healthy after {server.startup_s:.1f} s", flush=True)
    return server


def stop(server: Server) -> None:
    """SIGINT to the server's process group (a graceful shutdown), SIGKILL after a minute."""
    proc = server.proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    server.log.unlink(missing_ok=True)


def measure(servers: dict[str, Server], offline: subprocess.Popen | None, args) -> tuple[dict, list]:
    """Every rate on every server, the servers' runs back to back (first one alternating), so that
    a pair shares the VM's speed of that minute; the idle servers wait on their sockets meanwhile.
    After each rate-inf pair, the offline engine does the same work (fresh prompts of its own)."""
    results = {e: {"engine": e, "command": s.command, "startup_s": s.startup_s, "runs": [], "ok": True}
               for e, s in servers.items()}
    offline_runs: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        for seed, rate in enumerate(args.rates):  # fresh prompts for each run: no prefix-cache hits
            order = list(servers) if seed % 2 == 0 else list(reversed(servers))
            for e in order:
                if not results[e]["ok"]:
                    continue
                try:
                    full = bench(rate, seed, servers[e].port, args, Path(d))
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    results[e].update(ok=False, error=str(exc), log_tail=servers[e].log.read_text()[-3000:])
                    print(f"    {e} failed: {exc}", flush=True)
                    continue
                run = {"rate": rate, "seed": seed,
                       **{k: full.get(k) for k in (*METRICS, "completed", "duration", "max_concurrent_requests")}}
                results[e]["runs"].append(run)
                print(f"    {e} rate {rate}: {run['output_throughput']:.1f} out tok/s, TPOT "
                      f"{run['mean_tpot_ms']:.1f} ms, ITL p99 {run['p99_itl_ms']:.1f} ms", flush=True)
            if rate == "inf" and offline is not None:
                offline.stdin.write(f"{1000 + seed}\n")
                offline.stdin.flush()
                if line := offline.stdout.readline():
                    offline_runs.append({"seed": 1000 + seed, **json.loads(line)})
                    print(f"    offline engine: {offline_runs[-1]['output_throughput']:.1f} out tok/s", flush=True)
                else:
                    print("    the offline engine exited", flush=True)
                    offline = None
    return results, offline_runs


def offline_worker(args) -> None:
    """--offline-worker: load Tessera's offline engine, then for each seed read on stdin generate
    --num-prompts fresh prompts at once (what rate inf asks of a server) and print one JSON line.
    Sampling as the client leaves it to the server: Tessera's defaults (temperature 1)."""
    from throughput import make_prompts

    from tessera import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in make_prompts(2, 16, vocab, seed=99)],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompts = make_prompts(args.num_prompts, args.input_len, vocab, seed=int(line))
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"seconds": seconds, "output_throughput": tokens / seconds}), flush=True)


def start_offline(args) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--offline-worker", "--model", args.model, "--dtype", args.dtype,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len)]
    proc = subprocess.Popen(cmd, env=env_for("tessera", args.threads), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if "ready" not in proc.stdout.readline():  # loaded and warmed before any server is measured
        raise RuntimeError("the offline engine did not start")
    return proc


def _ratio(a: dict, b: dict, key: str) -> str:
    return f"{a[key] / b[key]:.2f}x" if a.get(key) and b.get(key) else "-"


def print_table(results: dict, offline: list, args) -> None:
    print(f"\n{args.model}, --dtype {args.dtype}; vllm bench serve: random {args.input_len} in x {args.output_len} "
          f"out, {args.num_prompts} prompts per run; {args.threads} threads, {cpu_name()}")
    print(f"{'engine':17s} {'rate':>5s} {'out tok/s':>9s} {'TTFT ms':>8s} {'p99':>7s} {'TPOT ms':>8s} {'p99':>7s} "
          f"{'ITL ms':>7s} {'p99':>7s}")
    for engine, r in results.items():
        if not r.get("ok"):
            print(f"{engine:17s} failed: {r.get('error', '?')[:120]}")
        for m in r.get("runs", []):
            print(f"{engine:17s} {m['rate']:>5s} {m['output_throughput']:9.1f} {m['mean_ttft_ms']:8.1f} "
                  f"{m['p99_ttft_ms']:7.1f} {m['mean_tpot_ms']:8.1f} {m['p99_tpot_ms']:7.1f} {m['mean_itl_ms']:7.1f} "
                  f"{m['p99_itl_ms']:7.1f}")
    by_seed = {m["seed"]: m for m in results.get("vllm", {}).get("runs", [])}
    for engine in (e for e in results if e.startswith("tessera") and by_seed):
        print(f"\n{engine} / vLLM, each run against the other engine's run at the same rate and minute "
              "(targets: tok/s >= 1.5x, TPOT and ITL p99 <= 0.67x)")
        for a in results[engine].get("runs", []):
            if (b := by_seed.get(a["seed"])) is not None:
                print(f"  rate {a['rate']:>4s}: tok/s {_ratio(a, b, 'output_throughput')}, TPOT "
                      f"{_ratio(a, b, 'mean_tpot_ms')}, ITL p99 {_ratio(a, b, 'p99_itl_ms')}")
    inf = [m for m in results.get("tessera", {}).get("runs", []) if m["rate"] == "inf"]
    for a, o in zip(inf, offline, strict=False):
        print(f"  Tessera's server at rate inf / its offline engine right after: "
              f"{a['output_throughput'] / o['output_throughput']:.0%} ({a['output_throughput']:.1f} vs "
              f"{o['output_throughput']:.1f} out tok/s; target >= 90%)")
    for engine, r in results.items():
        if "startup_s" in r:
            print(f"  {engine}: /health after {r['startup_s']:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="tessera,vllm",
                    help="tessera, tessera-autopilot (--autopilot --slo-itl-ms), vllm; comma-separated")
    ap.add_argument("--slo-itl-ms", type=float, default=200.0, help="tessera-autopilot's ITL objective")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="Tessera's model (vLLM loads --hf-folder)")
    ap.add_argument("--hf-folder", default=str(COMPETITORS / "models" / "smollm2-135m-f32"),
                    help="the transformers folder of the same weights (make_hf_folder.py): vLLM's model and "
                         "the client's tokenizer")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rates", default="2,4,8,inf", help="comma-separated request rates (requests/s; inf = all at once)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8471, help="the first server's port; the next one gets port + 1")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline reference")
    ap.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per client run")
    ap.add_argument("--out", default=str(HERE / "results" / "serve_compare.json"))
    args = ap.parse_args()
    if args.offline_worker:
        return offline_worker(args)
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} not found: vLLM's client runs in its venv (benchmarks/competitors/setup.sh)")

    servers: dict[str, Server] = {}
    failed: dict[str, dict] = {}
    offline = None
    try:
        for i, e in enumerate(n.strip() for n in args.engines.split(",") if n.strip()):
            try:
                servers[e] = start(e, args.port + i, args)
            except RuntimeError as exc:
                failed[e] = {"engine": e, "ok": False, "error": str(exc)}
                print(f"    failed: {exc}", flush=True)
        if not args.no_offline:
            offline = start_offline(args)
        measured, offline_runs = measure(servers, offline, args)
        results = {**measured, **failed}
    finally:
        for s in servers.values():
            stop(s)
        if offline is not None:
            offline.stdin.close()
            offline.wait(timeout=60)
    print_table(results, offline_runs, args)
    Path(args.out).write_text(json.dumps({
        "cpu": cpu_name(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "workload": {k: getattr(args, k) for k in ("model", "hf_folder", "dtype", "rates", "num_prompts",
                                                    "input_len", "output_len", "threads")},
        "results": results, "offline": offline_runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
