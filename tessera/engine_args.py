"""Engine flags shared by `tessera generate`, `tessera serve` and the benchmarks."""

from __future__ import annotations

import argparse

from tessera.config import INT4_GROUP_SIZES, KV_CACHE_DTYPES, QUANTIZATION_METHODS, SPARSITY_PATTERNS


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
    p.add_argument("--quantization", choices=list(QUANTIZATION_METHODS), default="none",
                   help="weight quantization at load: int8 / int4 weight-only, w8a8 (int8 weights and "
                        "activations), gguf (compute from a .gguf file's own Q4_0/Q4_1/Q8_0 blocks)")
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize the lm_head (output projection) too")
    p.add_argument("--quant-group-size", type=int, choices=list(INT4_GROUP_SIZES), default=32,
                   help="weights per scale / zero point in --quantization int4")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="KV cache elements: auto (the model dtype), int8 or fp8 (e4m3; both one byte plus a "
                        "scale per token and KV head: ~3.8x the tokens of a float32 pool; torch backend only)")
    p.add_argument("--sparsity", choices=list(SPARSITY_PATTERNS), default="none",
                   help="2:4: keep the 2 largest of each 4 weights of the linear layers (no speed-up on CPU; "
                        "saves memory only with --quantization none, which stores them compressed)")
    p.add_argument("--swap-space", type=float, default=0.0,
                   help="GiB of host memory for the host KV tier that preempted sequences are swapped to")
    p.add_argument("--preemption-mode", choices=["recompute", "swap", "auto"], default="auto",
                   help="how a preempted sequence gets its KV back (auto: swap when cheaper; needs --swap-space)")
    p.add_argument("--speculative-method", choices=["ngram", "draft"], default=None,
                   help="speculative decoding: ngram (prompt lookup, no extra model) or draft (--draft-model)")
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="most tokens proposed per step (k)")
    p.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="pick 0..k per step from measured acceptance and step costs (off: always k)")
    p.add_argument("--draft-model", default=None,
                   help="draft model for --speculative-method draft: a path, or self (the target, quantized)")
    p.add_argument("--draft-quantization", choices=list(QUANTIZATION_METHODS), default="none",
                   help="weight quantization of the draft model (e.g. --draft-model self --draft-quantization int8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--attention-backend", default="auto", help="auto | torch | triton (auto: triton on CUDA, torch on CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the model step eagerly (no torch.compile, no CUDA graphs): slower, starts at once")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels for every path (same tokens whatever the batch), at a measured cost")
    p.add_argument("--structured-outputs-backend", choices=["xgrammar"], default="xgrammar",
                   help="library that compiles JSON-schema / regex / choice / grammar constraints")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        quant_group_size=args.quant_group_size,
        kv_cache_dtype=args.kv_cache_dtype,
        sparsity=args.sparsity,
        swap_space=args.swap_space,
        preemption_mode=args.preemption_mode,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_adaptive=args.speculative_adaptive,
        draft_model=args.draft_model,
        draft_quantization=args.draft_quantization,
        seed=args.seed,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        deterministic=args.deterministic,
        structured_outputs_backend=args.structured_outputs_backend,
    )
