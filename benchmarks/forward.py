"""Time the model forward: prefill of one prompt, and one decode step at batch 1 and 32.

Runs without downloads: by default the model has random weights and the default model's shape
(SmolLM2-135M). Pass --model PATH to time real weights (a HF folder or a .gguf file).
Prints a table and writes JSON (default results/forward.json).

    python benchmarks/forward.py --dtype float32,bfloat16 --threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from tessera.attention.metadata import AttentionMetadata, single_sequence_metadata, slots_for_positions
from tessera.config import ModelConfig, resolve_dtype
from tessera.model.llama import LlamaForCausalLM

SMOLLM2_135M = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def build_model(model: str, dtype: torch.dtype, seed: int, kernels: str = "invariant") -> LlamaForCausalLM:
    """kernels: "invariant" (the C++ batch-invariant linears and attention, Tessera's default on
    CPU) or "torch" (oneDNN/MKL linears, the torch attention backend)."""
    m = _build_model(model, dtype, seed, "torch" if kernels == "torch" else "auto")
    if kernels == "invariant":
        from tessera.config import EngineConfig
        from tessera.engine.model_runner import prepare_step_kernels

        prepare_step_kernels(m, EngineConfig(), dtype)  # the engine's policy: bf16 on AMX only
    elif kernels == "deterministic":
        from tessera.kernels.linear import make_linears_invariant

        make_linears_invariant(m)  # fp32 too, as --deterministic does
    return m


def _build_model(model: str, dtype: torch.dtype, seed: int, backend: str) -> LlamaForCausalLM:
    if model == "random":
        m = LlamaForCausalLM(SMOLLM2_135M, dtype, attn_backend=backend)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 1:  # norm weights
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return m
    from tessera.model.weights import load_model_files

    files = load_model_files(model)
    m = LlamaForCausalLM(files.config, dtype, attn_backend=backend)
    m.load_weights(files.weights())
    return m


def timed(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_metadata(batch: int, context: int, block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """One decode step of `batch` sequences, each with `context` tokens (the new one included),
    on shuffled blocks: the gather pattern of a real cache, not a contiguous one."""
    blocks_per_seq = -(-context // block_size)
    free = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    slots = []
    for i in range(batch):
        table = free[i * blocks_per_seq : (i + 1) * blocks_per_seq]
        slots.append(slots_for_positions(table, 0, context, block_size))
    decode_slots = torch.tensor(slots, dtype=torch.long)
    return AttentionMetadata(
        slot_mapping=decode_slots[:, -1].clone(),
        num_decode_tokens=batch,
        decode_slots=decode_slots,
        decode_mask=torch.ones(batch, 1, 1, context, dtype=torch.bool),
        prefills=[],
        block_size=block_size,  # the invariant backend walks block tables; without it, it falls back
    )


def bench_dtype(args, dtype: torch.dtype) -> list[dict]:
    model = build_model(args.model, dtype, args.seed, args.kernels)
    cfg = model.config
    block_size = args.block_size
    max_batch = max(args.batch_sizes)
    tokens_needed = max(args.prefill_len, max_batch * args.context)
    num_blocks = 1 + -(-tokens_needed // block_size) + 1
    caches = model.allocate_kv_cache(num_blocks, block_size)
    for k_cache, v_cache in caches:  # decode timing does not depend on the values
        k_cache.normal_()
        v_cache.normal_()
    gen = torch.Generator().manual_seed(args.seed)
    rows = []

    ids = torch.randint(0, cfg.vocab_size, (args.prefill_len,), generator=gen)
    positions = torch.arange(args.prefill_len)
    md = single_sequence_metadata(args.prefill_len, block_size)

    def prefill():
        hidden = model(ids, positions, caches, md)
        model.compute_logits(hidden[-1:])

    seconds = timed(prefill, args.warmup, args.repeats)
    rows.append(dict(phase="prefill", batch=1, tokens=args.prefill_len, context=args.prefill_len, ms=seconds * 1e3,
                     tokens_per_s=args.prefill_len / seconds))

    for batch in args.batch_sizes:
        md = decode_metadata(batch, args.context, block_size, num_blocks, args.seed)
        ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
        positions = torch.full((batch,), args.context - 1, dtype=torch.long)

        def decode(ids=ids, positions=positions, md=md):
            hidden = model(ids, positions, caches, md)
            model.compute_logits(hidden)

        seconds = timed(decode, args.warmup, args.repeats)
        rows.append(dict(phase="decode", batch=batch, tokens=batch, context=args.context, ms=seconds * 1e3,
                         tokens_per_s=batch / seconds))
    for row in rows:
        row["dtype"] = str(dtype).removeprefix("torch.")
        row["kernels"] = args.kernels
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random",
                        help="'random' (SmolLM2-135M shape, random weights) or a model folder / .gguf path")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--context", type=int, default=256, help="decode context length per sequence")
    parser.add_argument("--batch-sizes", default="1,32", help="decode batch sizes, comma-separated")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", default="invariant", choices=["invariant", "deterministic", "torch"],
                        help="invariant: the engine's default on CPU (C++ attention; invariant linears in bf16 on "
                             "AMX); deterministic: invariant linears in fp32 too; torch: oneDNN/MKL + torch attention")
    parser.add_argument("--out", default="results/forward.json")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)

    rows = []
    for name in args.dtype.split(","):
        rows += bench_dtype(args, resolve_dtype(name))

    print(f"kernels: {args.kernels}")
    print(f"{'dtype':<9} {'phase':<8} {'batch':>5} {'context':>7} {'ms/step':>9} {'tokens/s':>9}")
    for r in rows:
        print(f"{r['dtype']:<9} {r['phase']:<8} {r['batch']:>5} {r['context']:>7} {r['ms']:>9.1f} {r['tokens_per_s']:>9.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(model=args.model, threads=args.threads, repeats=args.repeats, warmup=args.warmup,
                block_size=args.block_size, torch=torch.__version__, machine=platform.machine(),
                cpu_count=os.cpu_count())
    out.write_text(json.dumps(dict(config=meta, results=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
