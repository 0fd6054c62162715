"""Write the default model's GGUF (Q4_1) as a transformers-format folder (float32 safetensors plus
tokenizer) for the engines that cannot read GGUF themselves (vLLM, transformers' own generate).

The weights are the GGUF's Q4_1 blocks dequantized to float32 by transformers' GGUF loader, the
same dequantized values Tessera computes with in float32, so every float32 engine runs the same
model. Run it with Tessera's venv (it has transformers + gguf):

    .venv/bin/python benchmarks/competitors/make_hf_folder.py --out /work/competitors/models/smollm2-135m-f32
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tessera.config import DEFAULT_MODEL
from tessera.model.download import resolve_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a .gguf file or the default model's name")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gguf = resolve_model_path(args.model)
    out = Path(args.out)
    if (out / "config.json").is_file():
        print(f"{out} exists, keeping it")
        return
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers marks a GGUF load as "quantized" and refuses to save it, though its weights are
    # plain float32 tensors by now: rebuild an ordinary model from the config and copy them over.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
