"""How close each model step comes to what this machine allows (CPU roofline).

For the default model's shape (SmolLM2-135M, random weights; or --model PATH) it counts the
FLOPs and the bytes a step must move, for a prefill of 256 tokens and a decode step at batch 1
and 32 with 256 tokens of context; measures this machine's matmul rate (a large GEMM) and memory
bandwidth (a large copy and a large sum); times the real model's steps (benchmarks/forward.py's
helpers), and prints each step time next to its floor, max(FLOPs / rate, bytes / bandwidth).

What is counted:
- FLOPs: the matmuls (q/k/v, o, gate/up, down per layer; the lm_head on the rows that are
  sampled: the last prompt token, every decode row) and attention (QK^T and PV over the
  visible positions). Norms, rotary and SwiGLU are elementwise and left out (under 1%).
- Bytes: every weight read once, the KV cache read (the context) and written (the new
  tokens), the embedding rows gathered and the logits written. Activations are left out: at
  these sizes a layer's activations fit in the caches.

Issue 8's targets, checked at the end: decode at batch 1 within 2x of its memory floor; a
batch-32 decode step at most 1.5x the batch-1 step; prefill at 256 tokens at >= 50% of the
matmul rate.

Runs in float32 by default: bf16 is only worth it on a CPU with native bf16 (AVX512-BF16 /
AMX); on one without (e.g. Zen 3, AVX2 only) bf16 matmuls are emulated and slower than fp32,
which the script measures and prints.

    flock /tmp/tessera-bench.lock python benchmarks/roofline.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward import bench_dtype, build_model, timed  # noqa: E402

from tessera.config import ModelConfig, resolve_dtype  # noqa: E402
from tessera.model.layers import linear  # noqa: E402  (the engine's kernel where it swapped one in)

# ---- counting -------------------------------------------------------------------------------


def linear_weight_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of the matmul weights of one layer, as the model fuses them."""
    h, d = cfg.hidden_size, cfg.head_dim
    return [
        ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h),  # qkv
        (h, cfg.num_heads * d),  # o
        (2 * cfg.intermediate_size, h),  # gate_up
        (h, cfg.intermediate_size),  # down
    ]


def count_step(cfg: ModelConfig, tokens: int, contexts: list[tuple[int, int]], logit_rows: int,
               elem: int, kv_elem: int) -> dict:
    """FLOPs and bytes of one forward: `tokens` new tokens in all; `contexts` lists per sequence
    (new tokens, context length after the step); `logit_rows` rows go through the lm_head."""
    layer_params = sum(o * i for o, i in linear_weight_shapes(cfg))
    norm_params = 2 * cfg.hidden_size
    linear_flops = 2 * tokens * layer_params * cfg.num_layers
    # Attention: each new token at position p (0-based) sees p + 1 positions; 4*d FLOPs per pair and head.
    pairs = 0
    for new, ctx in contexts:
        first = ctx - new
        pairs += sum(first + j + 1 for j in range(new))
    attn_flops = 4 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers
    head_flops = 2 * logit_rows * cfg.hidden_size * cfg.vocab_size

    weight_bytes = (cfg.num_layers * (layer_params + norm_params) + cfg.hidden_size) * elem
    # The lm_head is read whole; the embedding table (the same matrix when tied) only row by row.
    lm_head_bytes = cfg.vocab_size * cfg.hidden_size * elem
    embed_rows = tokens * cfg.hidden_size * elem
    kv_row = 2 * cfg.num_kv_heads * cfg.head_dim * kv_elem * cfg.num_layers  # K and V, all layers
    kv_read = sum(ctx for _, ctx in contexts) * kv_row
    kv_write = tokens * kv_row
    logits = logit_rows * cfg.vocab_size * 4
    return dict(
        flops=linear_flops + attn_flops + head_flops,
        linear_flops=linear_flops, attention_flops=attn_flops, lm_head_flops=head_flops,
        bytes=weight_bytes + lm_head_bytes + embed_rows + kv_read + kv_write + logits,
        weight_bytes=weight_bytes + lm_head_bytes, kv_bytes=kv_read + kv_write,
    )


# ---- measuring the machine ------------------------------------------------------------------


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_matmul(dtype: torch.dtype, n: int, repeats: int) -> float:
    """FLOP/s of an n x n x n GEMM (best of `repeats`)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = best_of(lambda: torch.mm(a, b, out=out), repeats)
    return 2 * n**3 / seconds


def measure_bandwidth(mib: int, repeats: int) -> dict:
    """Bytes/s of a large copy (read + written) and a large sum (read), best of `repeats`."""
    src = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    copy = best_of(lambda: dst.copy_(src), repeats)
    total = best_of(lambda: src.sum(), repeats)
    return dict(copy=2 * nbytes / copy, read=nbytes / total)


def time_matmuls_only(model, rows: int, logit_rows: int, warmup: int, repeats: int) -> float:
    """Seconds for just the step's matmuls (every layer's linear with the model's weights or kernels, and
    the lm_head) on random activations: the step minus attention, elementwise ops and Python."""
    cfg = model.config
    x = torch.randn(rows, cfg.hidden_size, dtype=model.dtype)
    mid = torch.randn(rows, cfg.intermediate_size, dtype=model.dtype)
    att = torch.randn(rows, cfg.num_heads * cfg.head_dim, dtype=model.dtype)
    last = x[-logit_rows:]

    def run():
        for layer in model.layers:
            linear(x, layer.self_attn.qkv_proj)
            linear(att, layer.self_attn.o_proj)
            linear(x, layer.mlp.gate_up_proj)
            linear(mid, layer.mlp.down_proj)
        linear(last, model.lm_head)

    return timed(run, warmup, repeats)


# ---- report ---------------------------------------------------------------------------------


def rest_of_step(step: dict) -> str:
    """What the step spends beyond its matmuls, in words (timings on a busy machine can invert)."""
    rest_ms = (step["measured_s"] - step["matmuls_only_s"]) * 1e3
    if rest_ms < 0:
        return (f"the matmuls alone timed {-rest_ms:.0f} ms slower than the whole step: the machine was busy "
                "(see the load average), so rerun on a quiet one before reading more into it")
    return f"the other {rest_ms:.1f} ms of the step are attention, elementwise ops and Python/framework overhead"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random", help="'random' (SmolLM2-135M shape) or a model folder / .gguf")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (machine figures too)")
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gemm-size", type=int, default=2048)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--out", default="results/roofline.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    elem = torch.empty(0, dtype=dtype).element_size()

    # The machine.
    rate = measure_matmul(dtype, args.gemm_size, args.repeats)
    rate_bf16 = measure_matmul(torch.bfloat16, 1024, 3) if dtype != torch.bfloat16 else rate
    rate_fp32_1k = measure_matmul(torch.float32, 1024, 3)
    bw = measure_bandwidth(args.copy_mib, args.repeats)
    bandwidth = max(bw["copy"], bw["read"])
    machine = dict(matmul_flops=rate, matmul_dtype=str(dtype), gemm_size=args.gemm_size,
                   bf16_matmul_flops_1024=rate_bf16, fp32_matmul_flops_1024=rate_fp32_1k,
                   copy_bytes_per_s=bw["copy"], read_bytes_per_s=bw["read"], bandwidth_used=bandwidth,
                   threads=args.threads, cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                   load_average_1min=os.getloadavg()[0], torch=torch.__version__)

    # The model's steps, timed by benchmarks/forward.py.
    fwd_args = Namespace(model=args.model, block_size=16, batch_sizes=batch_sizes, prefill_len=args.prefill_len,
                         context=args.context, seed=0, warmup=args.warmup, repeats=args.repeats,
                         kernels="invariant")  # the engine's kernels, as build_model below
    timed_rows = bench_dtype(fwd_args, dtype)
    model = build_model(args.model, dtype, 0)
    cfg = model.config

    steps = []
    for row in timed_rows:
        if row["phase"] == "prefill":
            n = row["tokens"]
            counts = count_step(cfg, n, [(n, n)], 1, elem, elem)
            name, rows, logit_rows = f"prefill {n} tokens", n, 1
        else:
            b = row["batch"]
            counts = count_step(cfg, b, [(1, row["context"])] * b, b, elem, elem)
            name, rows, logit_rows = f"decode batch {b} (context {row['context']})", b, b
        seconds = row["ms"] / 1e3
        compute_floor = counts["flops"] / rate
        memory_floor = counts["bytes"] / bandwidth
        floor = max(compute_floor, memory_floor)
        matmul_s = time_matmuls_only(model, rows, logit_rows, args.warmup, args.repeats)
        steps.append(dict(step=name, phase=row["phase"], batch=row["batch"], tokens=row["tokens"],
                          measured_s=seconds, matmuls_only_s=matmul_s, flops=counts["flops"],
                          bytes=counts["bytes"], weight_bytes=counts["weight_bytes"], kv_bytes=counts["kv_bytes"],
                          compute_floor_s=compute_floor, memory_floor_s=memory_floor, floor_s=floor,
                          bound="compute" if compute_floor >= memory_floor else "memory",
                          ratio=seconds / floor, achieved_flops=counts["flops"] / seconds))

    print(f"machine: {machine['cpu_count']} CPUs (load average {machine['load_average_1min']:.1f} when measured), "
          f"{args.threads} torch thread(s); {dtype} GEMM {args.gemm_size}^3: "
          f"{rate / 1e9:.1f} GFLOP/s; bf16 vs fp32 GEMM 1024^3: {rate_bf16 / 1e9:.1f} vs {rate_fp32_1k / 1e9:.1f} "
          f"GFLOP/s; copy {bw['copy'] / 1e9:.1f} GB/s (read+write), sum {bw['read'] / 1e9:.1f} GB/s (read); "
          f"floors use {bandwidth / 1e9:.1f} GB/s")
    print()
    header = (f"{'step':<28} {'GFLOP':>7} {'MB':>7} {'compute':>9} {'memory':>9} {'floor':>9} {'bound':>7} "
              f"{'measured':>9} {'ratio':>6} {'matmuls':>9} {'GFLOP/s':>8}")
    print(header)
    print(f"{'':<28} {'':>7} {'':>7} {'floor ms':>9} {'floor ms':>9} {'ms':>9} {'':>7} {'ms':>9} {'':>6} "
          f"{'only ms':>9} {'':>8}")
    for s in steps:
        print(f"{s['step']:<28} {s['flops'] / 1e9:>7.2f} {s['bytes'] / 1e6:>7.1f} {s['compute_floor_s'] * 1e3:>9.1f} "
              f"{s['memory_floor_s'] * 1e3:>9.1f} {s['floor_s'] * 1e3:>9.1f} {s['bound']:>7} "
              f"{s['measured_s'] * 1e3:>9.1f} {s['ratio']:>6.2f} {s['matmuls_only_s'] * 1e3:>9.1f} "
              f"{s['achieved_flops'] / 1e9:>8.1f}")

    # Issue 8's targets.
    print()
    targets = []
    by_batch = {s["batch"]: s for s in steps if s["phase"] == "decode"}
    prefill = next((s for s in steps if s["phase"] == "prefill"), None)
    if 1 in by_batch:
        d1 = by_batch[1]
        ratio = d1["measured_s"] / d1["memory_floor_s"]
        targets.append(dict(target="decode batch 1 <= 2x its memory floor", value=ratio, limit=2.0, met=ratio <= 2.0,
                            why=f"matmuls alone take {d1['matmuls_only_s'] / d1['memory_floor_s']:.2f}x the floor; "
                                + rest_of_step(d1)))
    if 1 in by_batch and 32 in by_batch:
        d1, d32 = by_batch[1], by_batch[32]
        ratio = d32["measured_s"] / d1["measured_s"]
        floor_ratio = d32["floor_s"] / d1["floor_s"]
        targets.append(dict(target="decode batch 32 step <= 1.5x batch 1 step", value=ratio, limit=1.5,
                            met=ratio <= 1.5,
                            why=f"the floors alone are {floor_ratio:.2f}x apart: batch 32 is {d32['bound']}-bound "
                                f"({d32['flops'] / 1e9:.1f} GFLOP = {d32['compute_floor_s'] * 1e3:.0f} ms at the "
                                f"measured GEMM rate; its KV reads add {d32['kv_bytes'] / 1e6:.0f} MB to "
                                f"{d32['weight_bytes'] / 1e6:.0f} MB of weights)"))
    if prefill:
        frac = prefill["achieved_flops"] / rate
        targets.append(dict(target=f"prefill {prefill['tokens']} tokens >= 50% of the matmul rate", value=frac,
                            limit=0.5, met=frac >= 0.5,
                            why=f"matmuls alone reach {prefill['flops'] / prefill['matmuls_only_s'] / rate:.0%} of "
                                f"the rate at the model's shapes (M={prefill['tokens']}, K={cfg.hidden_size} or "
                                f"{cfg.intermediate_size}: small GEMMs); " + rest_of_step(prefill)))
    for t in targets:
        print(f"{'MET ' if t['met'] else 'MISS'} {t['target']}: {t['value']:.2f} (limit {t['limit']}) - {t['why']}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine, model=args.model, steps=steps, targets=targets), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
