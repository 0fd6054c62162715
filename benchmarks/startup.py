"""Start-up: `LLM(model)` to its first token in a fresh process, warm and cold, and its peak RSS.

Each run is a new Python process that imports tessera, builds `LLM(--model, dtype=--dtype)` (load,
kernel packing and the engine's warm-up included) and generates one token; it reports its own
clock from before `import tessera` and its peak resident memory (`ru_maxrss`). Warm runs use the
kernel cache as it is (build it first: `python -m tessera.native`); a cold run points
TORCH_EXTENSIONS_DIR at an empty folder, so the C++ kernels are compiled as on a fresh machine
(the model file and its converted tokenizer stay cached: a first download is not timed here).
Prints a table (median and range per kind) and writes JSON.

    python benchmarks/startup.py --warm 3 --cold 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_name  # benchmarks/ is the script's folder

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from tessera import LLM, SamplingParams
t_import = time.perf_counter()
llm = LLM(sys.argv[1], dtype=sys.argv[2])
t_llm = time.perf_counter()
llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
t_first = time.perf_counter()
print(json.dumps({"import_s": t_import - t0, "llm_s": t_llm - t_import, "first_token_s": t_first - t0,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def run_once(model: str, dtype: str, extensions_dir: str | None) -> dict:
    env = dict(os.environ)
    if extensions_dir is not None:
        env["TORCH_EXTENSIONS_DIR"] = extensions_dir
    out = subprocess.run([sys.executable, "-c", CHILD, model, dtype], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--warm", type=int, default=3, help="runs with the kernel cache as it is")
    ap.add_argument("--cold", type=int, default=1, help="runs that compile the kernels into an empty folder")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "startup.json"))
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"warm": [], "cold": []}
    for _ in range(args.warm):
        runs["warm"].append(run_once(args.model, args.dtype, None))
    for _ in range(args.cold):
        with tempfile.TemporaryDirectory(prefix="tessera-cold-") as empty:
            runs["cold"].append(run_once(args.model, args.dtype, empty))
    print(f"{args.model}, --dtype {args.dtype}, {cpu_name()}")
    print(f"{'kind':<6} {'runs':>4} {'first token s':>22} {'of which import s':>18} {'peak RSS GB':>12}")
    for kind, rows in runs.items():
        if not rows:
            continue
        first = [r["first_token_s"] for r in rows]
        rss = [r["peak_rss_gb"] for r in rows]
        print(f"{kind:<6} {len(rows):>4} {statistics.median(first):>8.1f} ({min(first):.1f}-{max(first):.1f})"
              f"{statistics.median(r['import_s'] for r in rows):>18.1f} {max(rss):>12.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "cpu": cpu_name(), "runs": runs},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
