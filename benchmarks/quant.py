"""Quantization modes on the default model: weight memory, perplexity, prefill and decode speed.

For each mode (fp32 = unquantized float32, bf16 = unquantized bfloat16, int8, int4, w8a8, gguf,
all quantized modes with float32 activations) the model is loaded and quantized as the engine
does it, then: the bytes its weights take, its perplexity over data/pride_and_prejudice.txt
(tessera.quality), prefill tokens/s of one 256-token prompt, and decode tokens/s of one step at
batch 1 and 32 (each sequence 256 tokens of context, logits of every row computed). Every figure
is also given relative to bf16 (what the issue asks) and to fp32 (the fast dtype of a CPU without
native bf16, where bf16 GEMMs are emulated). Prints a table and writes JSON (results/quant.json).

    python benchmarks/quant.py --ppl-tokens 1024
    python benchmarks/quant.py --kernels   # the per-kernel sweep
    python benchmarks/quant.py --modes fp32,int8 --kv-cache-dtype int8   # decode over an int8 KV cache

`--kernels` times every kernel of every mode on the default model's weight shapes for a range of
row counts, weights cold in cache (as in a forward pass, where each layer's weights were evicted
since their last use): the measurements behind the kernel choice in tessera/quant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward import timed  # noqa: E402

from tessera.attention.metadata import AttentionMetadata, single_sequence_metadata, slots_for_positions
from tessera.config import DEFAULT_MODEL
from tessera.quality import load_model, perplexity, text_token_ids
from tessera.quant import weight_memory_bytes
from tessera.quant.kv import allocate_kv_cache

TARGETS = "targets: int4 and w8a8 decode b1 >= 1.5x; w8a8 decode b32 > 1x; perplexity int8/w8a8 <= +2%, int4 <= +10%"


def decode_metadata(batch: int, context: int, block_size: int) -> AttentionMetadata:
    """One decode step of `batch` sequences with `context` tokens each, in disjoint blocks."""
    blocks = -(-context // block_size)
    slots = [slots_for_positions(list(range(1 + i * blocks, 1 + (i + 1) * blocks)), 0, context, block_size)
             for i in range(batch)]
    decode_slots = torch.tensor(slots, dtype=torch.long)
    return AttentionMetadata(slot_mapping=decode_slots[:, -1].clone(), num_decode_tokens=batch,
                             decode_slots=decode_slots, decode_mask=torch.ones(batch, 1, 1, context, dtype=torch.bool),
                             prefills=[])


# Modes that are not a --quantization method: the unquantized model in a float dtype.
FLOAT_MODES = {"fp32": "float32", "bf16": "bfloat16"}


def bench_mode(args, mode: str) -> dict:
    t0 = time.perf_counter()
    dtype, method = (FLOAT_MODES[mode], "none") if mode in FLOAT_MODES else ("float32", mode)
    model, tokenizer = load_model(args.model, dtype, method, args.quantize_lm_head, args.quant_group_size)
    load_s = time.perf_counter() - t0
    row = {"mode": mode, "load_s": load_s, "weight_mib": weight_memory_bytes(model) / 2**20}
    ids = text_token_ids(tokenizer)
    if args.ppl_tokens:
        ids = ids[: args.ppl_tokens]
    t0 = time.perf_counter()
    row["perplexity"] = perplexity(model, ids, args.window, args.stride).perplexity
    row["ppl_s"] = time.perf_counter() - t0

    bs, vocab = 16, model.config.vocab_size
    max_batch = max(args.batch_sizes)
    caches = allocate_kv_cache(model, 1 + max_batch * -(-max(args.context, args.prefill_len) // bs), bs,
                               args.kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.prefill_len,), generator=gen)
    md = single_sequence_metadata(args.prefill_len, bs)

    def prefill():
        hidden = model(prompt, torch.arange(args.prefill_len), caches, md)
        model.compute_logits(hidden[-1:])

    slow = mode == "bf16"  # emulated bf16 GEMMs: one timed run is minutes' worth already
    row["prefill_tok_s"] = args.prefill_len / timed(prefill, 0 if slow else 1, 1 if slow else args.repeats)
    for layer in caches:  # decode speed does not depend on the cached values, only finite ones
        for t in layer:
            if t.dtype == torch.int8:
                t.random_(-127, 128, generator=gen)
            elif t.dtype in (torch.float32, torch.bfloat16, torch.float16):
                t.normal_(generator=gen).abs_()
    for batch in args.batch_sizes:
        dmd = decode_metadata(batch, args.context, bs)
        tokens = torch.randint(0, vocab, (batch,), generator=gen)
        positions = torch.full((batch,), args.context - 1, dtype=torch.long)

        def decode(tokens=tokens, positions=positions, dmd=dmd):
            model.compute_logits(model(tokens, positions, caches, dmd))

        row[f"decode_b{batch}_tok_s"] = batch / timed(decode, 1 if slow else 2, args.repeats if slow else args.repeats * 2)
    return row


def print_table(rows: list[dict], batch_sizes: list[int], base_mode: str) -> None:
    """One table with every figure relative to the `base_mode` row (bf16 or fp32)."""
    base = next((r for r in rows if r["mode"] == base_mode), None)

    def rel(r: dict, key: str) -> str:
        return f"{r[key] / base[key]:.2f}x" if base else "-"

    cols = [("prefill_tok_s", "prefill tok/s")] + [(f"decode_b{b}_tok_s", f"decode b{b} tok/s") for b in batch_sizes]
    print(f"relative to {base_mode}:" if base else f"(no {base_mode} row: absolute figures only)")
    header = f"{'mode':<6} {'weights MiB':>14} {'perplexity':>16}" + "".join(f" {name:>20}" for _, name in cols)
    print(header)
    print("-" * len(header))
    for r in rows:
        ppl = f"{r['perplexity']:.3f} ({100 * (r['perplexity'] / base['perplexity'] - 1):+.1f}%)" if base else \
            f"{r['perplexity']:.3f}"
        mem = f"{r['weight_mib']:.1f} ({rel(r, 'weight_mib')})"
        line = f"{r['mode']:<6} {mem:>14} {ppl:>16}"
        for key, _ in cols:
            line += f" {f'{r[key]:.1f} ({rel(r, key)})':>20}"
        print(line)


# ---- the kernel sweep --------------------------------------------------------------------------


def kernel_sweep(args) -> list[dict]:
    from tessera.quant.int4 import Int4Linear
    from tessera.quant.int8 import Int8Linear
    from tessera.quant.w8a8 import W8A8Linear

    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "lm_head": (49152, 576)}
    rows = []
    for name, (n, k) in shapes.items():
        # Enough copies to exceed the L3 cache, so each call reads its weight from memory.
        copies = max(2, (128 << 20) // (n * k * 4))
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(copies)]
        layers = {
            "fp32": weights,
            "int8": [Int8Linear.from_float(w) for w in weights],
            "int4": [Int4Linear.from_float(w, args.quant_group_size) for w in weights],
            "w8a8": [W8A8Linear.from_float(w) for w in weights],
        }
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            result = {"shape": name, "rows": m}
            for mode, ls in layers.items():
                kernels = ("F.linear",) if mode == "fp32" else ls[0].kernels
                for kernel in kernels:
                    if kernel == "int_mm" and m * n > 64 * 3072:
                        continue  # a plain loop on CPUs without VNNI: minutes at this size
                    if mode == "fp32":
                        calls = [lambda w=w, x=x: F.linear(x, w) for w in ls]
                    else:
                        calls = [lambda layer=layer, kernel=kernel, x=x: layer(x, kernel=kernel) for layer in ls]
                    seconds = timed(lambda calls=calls: [c() for c in calls], 1, args.repeats) / len(calls)
                    result[f"{mode}:{kernel}"] = seconds * 1e6
            rows.append(result)
            print(f"{name:<8} M={m:<4} " + " ".join(f"{key}={v:.0f}us" for key, v in result.items()
                                                   if key not in ("shape", "rows")), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--modes", default="fp32,bf16,int8,int4,w8a8,gguf",
                   help="fp32 / bf16: unquantized in that dtype; else a --quantization method (float32 activations)")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV cache of the decode timings: auto | int8 | fp8")
    p.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--quant-group-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the cores are shared)")
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--context", type=int, default=256, help="tokens of context of each decoding sequence")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=384)
    p.add_argument("--ppl-tokens", type=int, default=0, help="score only the first N tokens of the text (0: all)")
    p.add_argument("--kernels", action="store_true", help="time each kernel per shape and row count instead")
    p.add_argument("--rows", default="1,4,8,16,32,256", help="row counts of --kernels")
    p.add_argument("--out", default=None, help="JSON output (default results/quant.json or quant_kernels.json)")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*quantized tensor.*")
    info = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": args.threads, "machine": platform.machine(), "cpus": os.cpu_count()}
    if args.kernels:
        rows = kernel_sweep(args)
        out = Path(args.out or "results/quant_kernels.json")
    else:
        print(f"{args.model}, float32 activations, {args.threads} thread(s), lm_head "
              f"{'quantized' if args.quantize_lm_head else 'float'}, int4 group {args.quant_group_size}; "
              f"prefill {args.prefill_len} tokens, decode at {args.context} tokens of context, "
              f"KV cache {args.kv_cache_dtype}")
        rows = []
        for mode in args.modes.split(","):
            rows.append(bench_mode(args, mode))
            print(f"  {mode}: " + ", ".join(f"{k}={v:.2f}" for k, v in rows[-1].items() if k != "mode"), flush=True)
        for base_mode in ("bf16", "fp32"):
            print()
            print_table(rows, args.batch_sizes, base_mode)
        print(TARGETS + " (relative to bf16)")
        out = Path(args.out or "results/quant.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "args": {k: v for k, v in vars(args).items()}, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
