"""transformers `generate` on the compare.py workload (Tessera's venv): the baseline of
benchmarks/throughput.py (static batches of equal-length prompts, its best case: compare.py asks
for one batch of all of them), then one request at a time. Weights: the GGUF dequantized by
transformers' own loader, computed in --dtype.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import load_workload, parts, run_and_write, runner_args, single_stream, throughput_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: throughput.py


def main() -> None:
    ap = runner_args(__doc__)
    ap.add_argument("--static-batch", type=int, default=8)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    args = ap.parse_args()
    w = load_workload(args.workload)

    def body() -> dict:
        import torch
        import transformers
        from throughput import run_hf_baseline
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(w["threads"])
        dtype = getattr(torch, args.dtype)
        gguf = Path(w["gguf_q4_1"])
        out_len = w["output_len"]

        def offline() -> dict:
            seconds = run_hf_baseline(gguf, w["throughput_prompts"], out_len, dtype, args.static_batch)
            return throughput_result(seconds, w["throughput_prompts"], out_len)

        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()

        def generate(prompt: list[int], n: int) -> None:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + n

        measured = parts(w, offline, lambda: single_stream(generate, w["single_prompts"], out_len, w["single_reps"]))
        return {"version": f"transformers {transformers.__version__}", "torch": torch.__version__,
                "threads": torch.get_num_threads(), "dtype": args.dtype,
                "mode": f"static batches of {args.static_batch}", **measured}

    run_and_write(args.out, body)


if __name__ == "__main__":
    sys.exit(main())
