"""llama.cpp's own benchmark tool, llama-bench (built by setup.sh from the same vendored source as
llama-cpp-python), on compare.py's single-stream workload: the figures llama.cpp publishes for
itself, next to run_llamacpp.py's through its C API.

- TTFT: one input_len-token prompt from an empty context (`-p input_len -n 0`): input_len /
  pp t/s. llama-bench times the batch's llama_decode and leaves out sampling the first token
  (under a millisecond here), so this is a little kinder to llama.cpp than the other engines' TTFT.
- decode: output_len tokens after an input_len-token context (`-n output_len -d input_len`).

Both with flash attention on and off (best of the two is the result, both are kept) and weight
repacking as --repack says (llama.cpp's AMX / AVX-512 repacked layouts): off by default, because on
the AMX Xeon (model 207) repacking Q4_1 dies with SIGILL at `tileloadd` in ggml's AMX
`tinygemm_kernel_amx` (gdb backtrace in docs/compare.md), which takes the whole llama-bench run with it.
Throughput (offline) is not measured here: llama-bench runs one sequence.
"""

from __future__ import annotations

import json
import subprocess
import sys

from common import load_workload, run_and_write, runner_args


def bench(binary: str, gguf: str, threads: int, reps: int, repack: str, extra: list[str]) -> list[dict]:
    cmd = [binary, "-m", gguf, "-t", str(threads), "-r", str(reps), "-fa", "0,1", "--repack", repack, "-o", "json",
           *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main() -> None:
    ap = runner_args(__doc__)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--bench", required=True, help="the llama-bench binary")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--repack", default="0", help="llama-bench's --repack list: 0, 1 or 0,1")
    args = ap.parse_args()
    w = load_workload(args.workload)

    def body() -> dict:
        n_in, n_out, threads = w["input_len"], w["output_len"], w["threads"]
        pp = bench(args.bench, args.gguf, threads, args.reps, args.repack, ["-p", str(n_in), "-n", "0"])
        tg = bench(args.bench, args.gguf, threads, args.reps, args.repack, ["-p", "0", "-n", str(n_out), "-d", str(n_in)])
        best_pp = max(pp, key=lambda r: r["avg_ts"])
        best_tg = max(tg, key=lambda r: r["avg_ts"])
        keep = ("n_prompt", "n_gen", "n_depth", "flash_attn", "repack", "avg_ts", "stddev_ts")
        return {"version": f"llama.cpp {best_pp.get('build_commit', '?')} (build {best_pp.get('build_number', '?')}), "
                           f"llama-bench",
                "gguf": args.gguf, "threads": threads, "cpu_info": best_pp.get("cpu_info"),
                "single": {"ttft_s": n_in / best_pp["avg_ts"], "decode_tok_s": best_tg["avg_ts"],
                           "ttft_config": {k: best_pp.get(k) for k in ("flash_attn", "repack")},
                           "decode_config": {k: best_tg.get(k) for k in ("flash_attn", "repack")}},
                "runs": [{k: r.get(k) for k in keep} for r in pp + tg]}

    run_and_write(args.out, body)


if __name__ == "__main__":
    sys.exit(main())
