"""Write an F32 (or BF16, F16) GGUF from the packaged Q4_1 GGUF with llama.cpp's own quantizer
(llama_model_quantize, allow_requantize: the Q4_1 blocks are dequantized, then stored as F32/BF16/F16).
The F32 file holds exactly the values Tessera computes with in float32, so llama.cpp can be timed
on the same weights. Run it with the llama.cpp venv:

    /work/competitors/llamacpp/bin/python benchmarks/competitors/convert_gguf.py IN.gguf OUT.gguf --type f32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", choices=["f32", "bf16", "f16"], default="f32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if Path(args.dst).is_file():
        print(f"{args.dst} exists, keeping it")
        return
    import llama_cpp as lc

    lc.llama_backend_init()
    p = lc.llama_model_quantize_default_params()
    p.ftype = {"f32": lc.LLAMA_FTYPE_ALL_F32, "bf16": lc.LLAMA_FTYPE_MOSTLY_BF16, "f16": lc.LLAMA_FTYPE_MOSTLY_F16}[args.type]
    p.allow_requantize = True
    p.nthread = args.threads
    Path(args.dst).parent.mkdir(parents=True, exist_ok=True)
    rc = lc.llama_model_quantize(args.src.encode(), args.dst.encode(), p)
    if rc != 0:
        sys.exit(f"llama_model_quantize returned {rc}")
    print(f"wrote {args.dst}")


if __name__ == "__main__":
    main()
