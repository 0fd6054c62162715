"""Engine flags shared by `tessera generate`, `tessera serve` and the benchmarks."""

from __future__ import annotations

import argparse


def parse_memory(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB' or plain bytes -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (auto: bf16 only where the CPU has native bf16)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    p.add_argument("--kv-cache-memory", type=parse_memory, default=None, help="KV cache pool size, e.g. 2GiB")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--swap-space", type=float, default=0.0,
                   help="GiB of host memory for the host KV tier that preempted sequences are swapped to")
    p.add_argument("--preemption-mode", choices=["recompute", "swap", "auto"], default="auto",
                   help="how a preempted sequence gets its KV back (auto: swap when cheaper; needs --swap-space)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--attention-backend", default="auto", help="auto | torch | triton (auto: triton on CUDA, torch on CPU)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        swap_space=args.swap_space,
        preemption_mode=args.preemption_mode,
        seed=args.seed,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
    )
