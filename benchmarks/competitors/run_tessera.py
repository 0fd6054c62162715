"""Tessera on the compare.py workload (Tessera's venv): offline throughput through LLM.generate,
then one request at a time. --quantization none computes in --dtype from the GGUF dequantized at
load; gguf keeps the file's blocks (Q4_1, Q4_K, ...) and computes its activations in --dtype.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from common import Timer, load_workload, parts, run_and_write, runner_args, single_stream, throughput_result


def main() -> None:
    ap = runner_args(__doc__)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true", help="the module path (no native decoder stack)")
    args = ap.parse_args()
    w = load_workload(args.workload)

    def body() -> dict:
        import torch

        import tessera
        from tessera import LLM, SamplingParams

        with Timer() as load:
            llm = LLM(w["gguf_q4_1"], dtype=args.dtype, quantization=args.quantization,
                      quantize_lm_head=args.quantize_lm_head, enforce_eager=args.enforce_eager,
                      max_num_batched_tokens=512, max_num_seqs=64, num_threads=w["threads"])
        dtype = str(llm.engine.dtype).removeprefix("torch.")

        def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            assert all(len(o) == n for o in outs)
            return outs

        out_len = w["output_len"]

        def offline() -> dict:
            generate(w["throughput_prompts"][:2], 4)  # warm-up
            t0 = time.perf_counter()
            outs = generate(w["throughput_prompts"], out_len)
            tput = throughput_result(time.perf_counter() - t0, w["throughput_prompts"], out_len)
            tput["first_request_tokens"] = outs[0]
            t0 = time.perf_counter()
            generate(w["prefill_prompts"], 1)  # as many fresh prompts (no prefix-cache hits), 1 token each
            tput["prefill_only_s"] = time.perf_counter() - t0
            return tput

        measured = parts(w, offline, lambda: single_stream(lambda p, n: generate([p], n), w["single_prompts"],
                                                           out_len, w["single_reps"]))
        repo = Path(tessera.__file__).resolve().parents[1]  # the checkout measured (PYTHONPATH)
        commit = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"],
                                capture_output=True, text=True).stdout.strip() or os.environ.get("TESSERA_COMMIT", "?")
        return {"version": f"tessera {tessera.__version__} ({commit})", "torch": torch.__version__,
                "threads": torch.get_num_threads(), "dtype": dtype, "quantization": args.quantization, "quantize_lm_head": args.quantize_lm_head,
                "load_s": load.seconds, **measured}

    run_and_write(args.out, body)


if __name__ == "__main__":
    sys.exit(main())
