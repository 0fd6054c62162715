"""Time one layer's attention call: the invariant C++ kernel against the torch backend and SDPA.

SmolLM2-135M's attention shape by default (9 query heads, 3 KV heads, head_dim 64), bf16 K/V on
shuffled blocks (the access pattern of a real cache), each call on the next of --layers caches (a
model's 30 layers of KV do not stay in the CPU caches; --layers 1 measures one that does). Cases: decode at batch 1 and 32 with
--context tokens each, prefill of one fresh prompt of each --prefill-lens length. Columns:

- invariant: `InvariantCPUAttention.forward` (the CPU default: cache write + paged kernel, on
  AMX tiles for bf16 where the CPU has them, else with bf16-pair scores where it has AVX-512 BF16);
- avx512: the same kernel held to its fp32 AVX-512 arithmetic (`invariant_cpu.AMX = 0`);
- torch: `TorchCPUAttention.forward` (gathers each context, matmul/SDPA);
- sdpa: `F.scaled_dot_product_attention` on contiguous, unpaged [1, H, L, d] tensors (causal
  for prefill, one query row per sequence for decode): no cache at all, the floor to compare to.

Prints a table (median ms per call, and the kernel's ratio to SDPA) and writes JSON.

    python benchmarks/attention.py --threads 2 --repeats 20
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import forward  # benchmarks/ is the script's folder
import machine
import torch
import torch.nn.functional as F

from tessera import kernels
from tessera.attention import invariant_cpu
from tessera.attention.invariant_cpu import InvariantCPUAttention
from tessera.attention.metadata import AttentionMetadata, single_sequence_metadata, slots_for_positions
from tessera.attention.torch_cpu import TorchCPUAttention


def cpu_name() -> str:
    """machine.cpu_name() and whether the CPU has the bf16 paths the kernel uses."""
    flags = kernels.cpu_flags()
    extra = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{machine.cpu_name()} ({', '.join(extra) or 'no avx512_bf16/amx'})"


def timed(fn, warmup: int, repeats: int) -> float:
    """Median milliseconds of fn (forward.timed gives seconds)."""
    return forward.timed(fn, warmup, repeats) * 1e3


def decode_metadata(batch: int, context: int, block_size: int, num_blocks: int, window: int | None,
                    gen: torch.Generator) -> AttentionMetadata:
    per_seq = -(-context // block_size)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    rows, tables = [], []
    for i in range(batch):
        table = free[i * per_seq : (i + 1) * per_seq]
        if window is not None:  # blocks behind every window are released (block 0), as the scheduler does
            first_live = max(0, context - window) // block_size
            table = [0] * first_live + table[first_live:]
        rows.append(slots_for_positions(table, 0, context, block_size))
        tables.append(table)
    slots = torch.tensor(rows, dtype=torch.long)
    return AttentionMetadata(slot_mapping=slots[:, -1].clone(), num_decode_tokens=batch, decode_slots=slots,
                             decode_mask=torch.ones(batch, 1, 1, context, dtype=torch.bool), prefills=[],
                             block_size=block_size, decode_block_tables=torch.tensor(tables, dtype=torch.long),
                             decode_context_lens=torch.full((batch,), context, dtype=torch.long))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=256, help="decode context per sequence")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prefill-lens", default="256,1024")
    ap.add_argument("--window", type=int, default=None, help="sliding window (decode and prefill)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30,
                    help="distinct caches the calls rotate through (a model's: they do not stay in the CPU caches; "
                         "1 times a cache that does)")
    ap.add_argument("--out", default="results/attention.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, hkv, d = (int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    bs = args.block_size
    batches = [int(b) for b in args.batch_sizes.split(",")]
    prefills = [int(n) for n in args.prefill_lens.split(",") if n]
    num_blocks = 2 + max([max(batches) * -(-args.context // bs)] + [-(-n // bs) for n in prefills])
    gen = torch.Generator().manual_seed(0)
    def layer_cache():
        cache = tuple(torch.randn(num_blocks * bs, hkv, d, generator=gen).to(dtype) for _ in range(2))
        if args.kv_cache_dtype != "auto":
            from tessera.quant.kv import _FORMATS, quantize

            codes, scales = zip(*(quantize(c, _FORMATS[args.kv_cache_dtype][0]) for c in cache), strict=True)
            cache = (*codes, *scales)
        return cache

    caches = [layer_cache() for _ in range(args.layers)]
    calls = itertools.count()
    scale = d**-0.5
    rows = []

    def case(name: str, md: AttentionMetadata, n_tokens: int, sdpa_fn) -> None:
        q = torch.randn(n_tokens, h, d, generator=gen).to(dtype)
        k = torch.randn(n_tokens, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n_tokens, hkv, d, generator=gen).to(dtype)
        row = dict(case=name)
        for label, backend, amx in (("invariant", InvariantCPUAttention(), -1), ("avx512", InvariantCPUAttention(), 0),
                                    ("torch", TorchCPUAttention(), -1)):
            def call(backend=backend):
                backend.begin_step(md)
                backend.forward(0, q, k, v, caches[next(calls) % len(caches)], md, scale, args.window)
            invariant_cpu.AMX = amx  # the kernel's arithmetic: AMX where it applies (-1) or AVX-512 (0)
            row[label] = timed(call, args.warmup, args.repeats)
        invariant_cpu.AMX = -1
        row["sdpa"] = timed(sdpa_fn, args.warmup, args.repeats)
        rows.append(row)

    for batch in batches:
        md = decode_metadata(batch, args.context, bs, num_blocks, args.window, gen)
        ctx = args.context if args.window is None else min(args.context, args.window)
        qs = torch.randn(batch, h, 1, d, generator=gen).to(dtype)
        ks = torch.randn(batch, hkv, ctx, d, generator=gen).to(dtype)
        vs = torch.randn(batch, hkv, ctx, d, generator=gen).to(dtype)
        case(f"decode b{batch} ctx{args.context}", md, batch,
             lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True))
    for n in prefills:
        md = single_sequence_metadata(n, bs)
        qs = torch.randn(1, h, n, d, generator=gen).to(dtype)
        ks = torch.randn(1, hkv, n, d, generator=gen).to(dtype)
        vs = torch.randn(1, hkv, n, d, generator=gen).to(dtype)
        case(f"prefill {n}", md, n,
             lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                                        enable_gqa=True))

    cpu = cpu_name()
    print(f"{cpu}, {args.threads} threads, torch {torch.__version__}, heads {h}/{hkv} d {d}, {args.dtype} "
          f"KV {args.kv_cache_dtype}, window {args.window}, {args.layers} caches in turn, median of {args.repeats} "
          f"(ms per layer call; invariant = AMX tiles where they apply, avx512 = the same kernel without them)")
    print(f"{'case':<22} {'invariant':>10} {'avx512':>9} {'torch':>9} {'sdpa':>9} {'inv/sdpa':>9}")
    for r in rows:
        print(f"{r['case']:<22} {r['invariant']:>10.3f} {r['avx512']:>9.3f} {r['torch']:>9.3f} {r['sdpa']:>9.3f} "
              f"{r['invariant'] / r['sdpa']:>9.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(cpu=cpu, threads=args.threads, torch=torch.__version__, heads=[h, hkv, d], dtype=args.dtype,
                kv_cache_dtype=args.kv_cache_dtype, window=args.window, repeats=args.repeats, block_size=bs,
                layers=args.layers)
    out.write_text(json.dumps(dict(config=meta, results=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
