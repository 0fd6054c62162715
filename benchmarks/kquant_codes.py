"""bf16 decode of a K-quant GGUF from its blocks against its bf16 weights, at a size that leaves the caches.

A Q4_K_M file's layers are mostly Q4_K and Q6_K; in bf16 (the default) their decode steps read the
blocks (tessera/quant/gguf_codes.py) with the bf16 weights' output bits. The packaged models are
too small for that to show (Gemma 3 270M's K-quant layers are a fifth of its token), so this
builds a Llama-3.2-1B-shaped model (hidden 2048, intermediate 8192, 32 / 8 heads of 64, --layers
layers, a tied Q8_0 embedding) whose layers are random --qtype blocks (gguf-py cannot quantize to
K-quants; the tests' random_blocks gives every code and scale pattern with finite scales), then
times one-stream decode (a 128-token prompt, 64 tokens out, median of --reps requests) in
alternating processes with the blocks and with TESSERA_GGUF_CODES=0 (the bf16 weights). Prints a
table and writes JSON.

    python benchmarks/kquant_codes.py --layers 6 --rounds 2
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from machine import cpu_name  # noqa: E402  (benchmarks/ is not a package)


def build(out: Path, layers: int, qtype_name: str) -> Path:
    """The GGUF file (random blocks of qtype in every layer linear)."""
    sys.path.insert(0, str(ROOT))
    import gguf

    from tests.tiny_model import make_tiny_model_dir, write_gguf_from_hf_dir
    from tests.unit.test_gguf_kquant import random_blocks

    q = gguf.GGMLQuantizationType
    qtype = q[qtype_name]
    folder = make_tiny_model_dir(out, num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=64,
                                 hidden_size=2048, intermediate_size=8192, tie_word_embeddings=True)
    quantize, seeds = gguf.quants.quantize, iter(range(10**6))
    gguf.quants.quantize = lambda t, kind: (random_blocks(kind, t.shape[0], t.shape[1], seed=next(seeds))
                                            if kind == qtype else quantize(t, kind))
    try:
        return write_gguf_from_hf_dir(folder, out / f"llama-1b-shape-{qtype_name.lower()}.gguf", qtype=qtype,
                                      qtypes={"model.embed_tokens.weight": q.Q8_0})
    finally:
        gguf.quants.quantize = quantize


def decode_ms(path: Path, reps: int) -> list[float]:
    """In this process: one-stream decode, ms a token, per request."""
    from tessera import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=512)
    vocab = llm.engine.runner.model.config.vocab_size

    def run(prompt: list[int], n: int) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t

    run([5, 6, 7, 8], 2)
    out = []
    for r in range(reps):  # every request a prompt of its own: no prefix-cache hits
        first = run([(r * 7919 + i * 31) % (vocab - 10) + 5 for i in range(128)], 1)
        full = run([(r * 104729 + i * 17) % (vocab - 10) + 5 for i in range(128)], 64)
        out.append((full - first) / 63 * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--qtype", default="Q4_K", choices=["Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--rounds", type=int, default=2, help="alternating pairs of processes")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default=str(HERE / "results" / "kquant_codes.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(decode_ms(Path(args.child), args.reps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp), args.layers, args.qtype)
        rows = []
        for r in range(args.rounds):
            for mode in ("blocks", "bf16") if r % 2 == 0 else ("bf16", "blocks"):
                env = {**os.environ, "TESSERA_GGUF_CODES": "1" if mode == "blocks" else "0"}
                done = subprocess.run([sys.executable, __file__, "--child", str(path), "--reps", str(args.reps)],
                                      env=env, capture_output=True, text=True, check=True)
                ms = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append({"round": r + 1, "weights": mode, "ms": ms, "median_ms": statistics.median(ms)})
                each = " ".join(f"{x:.1f}" for x in ms)
                print(f"round {r + 1} {mode:6s} {statistics.median(ms):6.1f} ms a token  ({each})", flush=True)
    by = {m: [row["median_ms"] for row in rows if row["weights"] == m] for m in ("blocks", "bf16")}
    ratios = ", ".join(f"{b / a:.2f}x" for a, b in zip(by["blocks"], by["bf16"], strict=True))
    print(f"{cpu_name()}: {args.layers} layers of random {args.qtype} blocks, Llama-3.2-1B shapes; "
          f"bf16 weights / blocks per round: {ratios}")
    Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "layers": args.layers, "qtype": args.qtype,
                                          "rows": rows}, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
