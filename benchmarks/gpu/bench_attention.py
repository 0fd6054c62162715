"""Time the Triton attention backend on an NVIDIA GPU and write benchmarks/gpu/RESULTS.md.

- Bandwidth: a large device-to-device copy (bytes read + written per second) and a large sum
  (bytes read per second): the HBM ceilings the decode floor is taken against.
- Decode: batch 64, context 4096, Llama-3-8B attention (32 query heads, 8 KV heads, head_dim
  128), bfloat16, block 16, blocks shuffled over the cache. Floor = bytes of K/V the step must
  read / copy bandwidth. A few tile/split settings are swept; each is checked against the
  default's output, and the default against the torch backend. Then the best setting is
  captured in a CUDA graph and replayed, to show what launch overhead costs.
- Prefill: 4 prompts of 2048 tokens (causal), same heads, against torch's flash SDPA on
  contiguous K/V; and chunked prefill (4 x 512 new tokens after 3584 cached) against flash SDPA
  with a lower-right causal mask. The Triton times include writing the new K/V to the cache.

Run through benchmarks/gpu/run.sh (which runs the kernel tests first); needs CUDA and triton.

    python benchmarks/gpu/bench_attention.py --out benchmarks/gpu/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from tessera.attention.metadata import AttentionMetadata, PrefillSpan, slots_for_positions
from tessera.attention.torch_cpu import TorchCPUAttention
from tessera.attention.triton_gpu import TritonAttention, TritonAttentionConfig, choose_splits

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


def bench_ms(fn, rep_ms: int = 200) -> float:
    """Median milliseconds of fn() (triton's do_bench: clears L2 between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def measure_bandwidth(gib: float = 4.0) -> dict:
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    sum_ms = bench_ms(lambda: src.sum(dtype=torch.float32))
    nbytes = src.numel() * src.element_size()
    return dict(bytes=nbytes, copy_ms=copy_ms, copy_gbs=2 * nbytes / copy_ms / 1e6,
                sum_ms=sum_ms, read_gbs=nbytes / sum_ms / 1e6)


def shuffled_tables(num_seqs: int, tokens: int, gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Block tables for num_seqs sequences of `tokens` each over a shuffled pool (block 0 kept
    for padding); returns (tables, number of blocks in the cache)."""
    per_seq = -(-tokens // BLOCK)
    num_blocks = 1 + num_seqs * per_seq
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    return [order[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)], num_blocks


def make_cache(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks * BLOCK, NUM_KV_HEADS, HEAD_DIM)
    return (torch.randn(shape, dtype=DTYPE, device=DEVICE), torch.randn(shape, dtype=DTYPE, device=DEVICE))


# ---- decode ---------------------------------------------------------------------------------

def decode_setup(batch: int, context: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_tables(batch, context, gen)
    cache = make_cache(num_blocks)
    slots = torch.tensor([slots_for_positions(t, 0, context, BLOCK) for t in tables], dtype=torch.long)
    metadata = AttentionMetadata(
        slot_mapping=slots[:, -1].contiguous().to(DEVICE),
        num_decode_tokens=batch,
        decode_slots=slots.to(DEVICE),
        decode_mask=torch.ones(batch, 1, 1, context, dtype=torch.bool, device=DEVICE),
        prefills=[],
    )
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    return q, k, v, cache, metadata


DECODE_CONFIGS = [
    dict(),  # the defaults
    dict(decode_block_n=32),
    dict(decode_block_n=128),
    dict(decode_block_n=128, decode_num_warps=8),
    dict(decode_num_stages=3),
    dict(decode_num_stages=4),
    dict(decode_block_n=128, decode_num_stages=3),
    dict(num_splits=1),
    dict(num_splits=2),
    dict(num_splits=4),
    dict(num_splits=8),
    dict(num_splits=16),
]


def bench_decode(bandwidth: dict, batch: int, context: int, quick: bool) -> dict:
    q, k, v, cache, metadata = decode_setup(batch, context)
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    other_bytes = batch * context * 8 + 2 * q.numel() * q.element_size()  # slot indices, q, out
    floor_ms = (kv_bytes + other_bytes) / (bandwidth["copy_gbs"] * 1e6)

    default = TritonAttention()
    reference = default.forward(0, q, k, v, cache, metadata, scale)
    torch_out = TorchCPUAttention().forward(0, q, k, v, cache, metadata, scale)
    torch_err = (reference.float() - torch_out.float()).abs().max().item()
    del torch_out
    torch.cuda.empty_cache()

    rows = []
    for overrides in DECODE_CONFIGS[:3] if quick else DECODE_CONFIGS:
        config = TritonAttentionConfig(**overrides)
        backend = TritonAttention(config)
        try:
            out = backend.forward(0, q, k, v, cache, metadata, scale)
            err = (out.float() - reference.float()).abs().max().item()
            ms = bench_ms(lambda b=backend: b.forward(0, q, k, v, cache, metadata, scale))
        except Exception as exc:  # a setting that fails to compile or run is reported, not fatal
            rows.append(dict(config=overrides, error=f"{type(exc).__name__}: {exc}"[:200]))
            continue
        splits, _ = choose_splits(batch, NUM_KV_HEADS, context, config, q.device)
        rows.append(dict(config=overrides or "default", splits=splits, ms=ms, max_abs_diff_vs_default=err,
                         kv_gbs=kv_bytes / ms / 1e6, pct_of_copy_bw=100 * kv_bytes / ms / 1e6 / bandwidth["copy_gbs"],
                         ratio_to_floor=ms / floor_ms))
    timed = [r for r in rows if "ms" in r and r["max_abs_diff_vs_default"] < 2e-2]
    best = min(timed, key=lambda r: r["ms"]) if timed else None

    graph = None
    if best is not None:
        try:
            graph = bench_decode_graph(best["config"], q, k, v, cache, metadata, scale)
        except Exception as exc:
            graph = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    return dict(batch=batch, context=context, kv_bytes=kv_bytes, floor_ms=floor_ms,
                max_abs_diff_vs_torch_backend=torch_err, configs=rows, best=best, cuda_graph=graph)


def bench_decode_graph(overrides, q, k, v, cache, metadata, scale) -> dict:
    """The same decode attention launched eagerly vs replayed from a CUDA graph."""
    backend = TritonAttention(TritonAttentionConfig(**(overrides if isinstance(overrides, dict) else {})))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            backend.forward(0, q, k, v, cache, metadata, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(0, q, k, v, cache, metadata, scale)
    graph.replay()
    eager = backend.forward(0, q, k, v, cache, metadata, scale)
    err = (out.float() - eager.float()).abs().max().item()

    def timed(fn, iters=50) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    return dict(eager_ms=timed(lambda: backend.forward(0, q, k, v, cache, metadata, scale)),
                graph_ms=timed(graph.replay), max_abs_diff=err)


# ---- prefill --------------------------------------------------------------------------------

def prefill_setup(num_seqs: int, cached: int, new: int, seed: int = 1):
    """num_seqs sequences with `cached` tokens already in the cache and `new` tokens this step.
    Returns (q, k, v, cache, metadata, contiguous K/V of the whole context [B, Hkv, ctx, d])."""
    gen = torch.Generator().manual_seed(seed)
    context = cached + new
    tables, num_blocks = shuffled_tables(num_seqs, context, gen)
    cache = make_cache(num_blocks)
    tokens = num_seqs * new
    q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    spans, new_slots, full_k, full_v = [], [], [], []
    for i, table in enumerate(tables):
        slots = torch.tensor(slots_for_positions(table, 0, context, BLOCK), dtype=torch.long, device=DEVICE)
        spans.append(PrefillSpan(i * new, new, context, slots))
        new_slots.append(slots[cached:])
        rows = slice(i * new, (i + 1) * new)
        full_k.append(torch.cat([cache[0][slots[:cached]], k[rows]]).transpose(0, 1))
        full_v.append(torch.cat([cache[1][slots[:cached]], v[rows]]).transpose(0, 1))
    metadata = AttentionMetadata(torch.cat(new_slots), 0, None, None, spans)
    return q, k, v, cache, metadata, torch.stack(full_k).contiguous(), torch.stack(full_v).contiguous()


PREFILL_CONFIGS = [
    dict(),
    dict(prefill_block_m=128, prefill_num_warps=8),
    dict(prefill_block_m=128, prefill_block_n=32, prefill_num_warps=8),
    dict(prefill_block_m=128, prefill_num_warps=8, prefill_num_stages=3),
    dict(prefill_block_m=128, prefill_block_n=128, prefill_num_warps=8),
    dict(prefill_block_m=64, prefill_num_stages=3),
]


def causal_flops(num_seqs: int, cached: int, new: int) -> float:
    """QK^T and PV over the visible (query, key) pairs: 4 * d FLOPs per pair and head."""
    pairs = new * cached + new * (new + 1) / 2
    return 4.0 * num_seqs * NUM_HEADS * HEAD_DIM * pairs


def flash_sdpa_fn(q, k, v, cached: int):
    """A no-argument call of torch's flash SDPA over contiguous q [B, H, n, d], k/v [B, Hkv, ctx, d],
    causal with the new tokens last (lower-right aligned when cached > 0). GQA through
    enable_gqa where this flash build takes it, else on K/V expanded beforehand (not timed)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    new, context = q.shape[2], k.shape[2]
    if cached:
        from torch.nn.attention.bias import causal_lower_right

        mask = dict(attn_mask=causal_lower_right(new, context))
    else:
        mask = dict(is_causal=True)

    def run(kk, vv, **gqa):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kk, vv, **mask, **gqa)

    try:
        run(k, v, enable_gqa=True)
        return lambda: run(k, v, enable_gqa=True)
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: run(k_full, v_full)


def bench_prefill(num_seqs: int, cached: int, new: int, quick: bool) -> dict:
    q, k, v, cache, metadata, full_k, full_v = prefill_setup(num_seqs, cached, new)
    scale = HEAD_DIM**-0.5
    flops = causal_flops(num_seqs, cached, new)
    result = dict(num_seqs=num_seqs, cached=cached, new=new, tflop=flops / 1e12, configs=[])

    reference = None
    qs = q.view(num_seqs, new, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    try:
        sdpa = flash_sdpa_fn(qs, full_k, full_v, cached)
        reference = sdpa().transpose(1, 2).reshape(num_seqs * new, NUM_HEADS * HEAD_DIM)
        sdpa_ms = bench_ms(sdpa)
        result["flash_sdpa"] = dict(ms=sdpa_ms, tflops=flops / sdpa_ms / 1e9)
    except Exception as exc:
        result["flash_sdpa"] = dict(error=f"{type(exc).__name__}: {exc}"[:200])

    for overrides in PREFILL_CONFIGS[:2] if quick else PREFILL_CONFIGS:
        backend = TritonAttention(TritonAttentionConfig(**overrides))
        try:
            out = backend.forward(0, q, k, v, cache, metadata, scale)
            row = dict(config=overrides or "default")
            if reference is not None:
                row["max_abs_diff_vs_sdpa"] = (out.float() - reference.float()).abs().max().item()
            ms = bench_ms(lambda b=backend: b.forward(0, q, k, v, cache, metadata, scale))
            row.update(ms=ms, tflops=flops / ms / 1e9)
            if "ms" in result.get("flash_sdpa", {}):
                row["vs_flash_sdpa"] = result["flash_sdpa"]["ms"] / ms
        except Exception as exc:
            row = dict(config=overrides, error=f"{type(exc).__name__}: {exc}"[:200])
        result["configs"].append(row)
    ok = [r for r in result["configs"] if "ms" in r and r.get("max_abs_diff_vs_sdpa", 0) < 5e-2]
    result["best"] = min(ok, key=lambda r: r["ms"]) if ok else None
    return result


# ---- report ---------------------------------------------------------------------------------

def fmt_config(c) -> str:
    if isinstance(c, str):
        return c
    return ", ".join(f"{k}={v}" for k, v in c.items()) or "default"


def render(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# GPU results: Triton attention backend",
        "",
        f"Written by `benchmarks/gpu/run.sh` on {env['date']} (UTC): {env['gpu']} ({env['sms']} SMs), "
        f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}. Every number below was "
        "measured by that run; rerun the script to refresh them.",
        "",
    ]
    tests = report.get("tests")
    if tests:
        lines += ["## Kernel tests on the GPU", "", f"`pytest` of test_triton_attention.py, test_triton_elementwise.py and test_decode_graphs.py (tests/unit): {tests}", ""]
    bw = report.get("bandwidth")
    if bw:
        lines += [
            "## Memory bandwidth", "",
            "| measurement | GB/s |", "| --- | ---: |",
            f"| device-to-device copy of {bw['bytes'] / 2**30:.0f} GiB (read + written) | {bw['copy_gbs']:.0f} |",
            f"| sum of {bw['bytes'] / 2**30:.0f} GiB (read) | {bw['read_gbs']:.0f} |", "",
        ]
    dec = report.get("decode")
    if dec and "configs" in dec:
        lines += [
            f"## Decode attention: batch {dec['batch']}, context {dec['context']}, {NUM_HEADS} q heads / "
            f"{NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, {str(DTYPE).removeprefix('torch.')}, block {BLOCK}", "",
            f"K/V read per step: {dec['kv_bytes'] / 1e9:.3f} GB; floor (all bytes / copy bandwidth): "
            f"{dec['floor_ms'] * 1e3:.1f} us. Default output vs the torch backend: max |diff| "
            f"{dec['max_abs_diff_vs_torch_backend']:.2e}. Target: >= 70% of copy bandwidth.", "",
            "| setting | splits | us | K/V GB/s | % of copy BW | time / floor | max diff vs default |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in dec["configs"]:
            if "error" in r:
                lines.append(f"| {fmt_config(r['config'])} | | failed: {r['error']} | | | | |")
            else:
                lines.append(f"| {fmt_config(r['config'])} | {r['splits']} | {r['ms'] * 1e3:.1f} | {r['kv_gbs']:.0f} | "
                             f"{r['pct_of_copy_bw']:.1f} | {r['ratio_to_floor']:.2f} | {r['max_abs_diff_vs_default']:.1e} |")
        if dec.get("best"):
            b = dec["best"]
            lines += ["", f"Best: {fmt_config(b['config'])} at {b['pct_of_copy_bw']:.1f}% of copy bandwidth "
                          f"({'meets' if b['pct_of_copy_bw'] >= 70 else 'misses'} the 70% target)."]
        g = dec.get("cuda_graph")
        if g:
            if "error" in g:
                lines += ["", f"CUDA graph capture of the decode attention failed: {g['error']}"]
            else:
                lines += ["", f"CUDA graph (best setting, write + decode + merge kernels): eager {g['eager_ms'] * 1e3:.1f} us, "
                              f"replay {g['graph_ms'] * 1e3:.1f} us per call (max |diff| {g['max_abs_diff']:.1e})."]
        lines.append("")
    elif dec:
        lines += ["## Decode attention", "", f"failed: {dec.get('error')}", ""]
    for pre in report.get("prefill", []):
        if "configs" not in pre:
            lines += ["## Prefill attention", "", f"failed: {pre.get('error')}", ""]
            continue
        lines += [
            f"## Prefill attention: {pre['num_seqs']} sequences x {pre['new']} new tokens after {pre['cached']} cached "
            f"(causal, {pre['tflop']:.2f} TFLOP)", "",
        ]
        sdpa = pre.get("flash_sdpa")
        if sdpa and "ms" in sdpa:
            lines += [f"torch flash SDPA on contiguous K/V: {sdpa['ms'] * 1e3:.1f} us, {sdpa['tflops']:.0f} TFLOP/s.", ""]
        elif sdpa:
            lines += [f"torch flash SDPA failed: {sdpa['error']}", ""]
        lines += ["| setting | us | TFLOP/s | speed vs flash SDPA | max diff vs SDPA |", "| --- | ---: | ---: | ---: | ---: |"]
        for r in pre["configs"]:
            if "error" in r:
                lines.append(f"| {fmt_config(r['config'])} | failed: {r['error']} | | | |")
            else:
                vs = f"{r['vs_flash_sdpa']:.2f}x" if "vs_flash_sdpa" in r else "-"
                diff = f"{r['max_abs_diff_vs_sdpa']:.1e}" if "max_abs_diff_vs_sdpa" in r else "-"
                lines.append(f"| {fmt_config(r['config'])} | {r['ms'] * 1e3:.1f} | {r['tflops']:.0f} | {vs} | {diff} |")
        lines.append("")
    for err in report.get("errors", []):
        lines += ["## Error", "", "```", err, "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/gpu/RESULTS.md")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    parser.add_argument("--tests", default=None, help="one-line summary of the kernel test run, for the report")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="fewer settings in the sweeps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs an NVIDIA GPU and a CUDA build of torch")
    import triton

    props = torch.cuda.get_device_properties(0)
    report: dict = dict(environment=dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), gpu=props.name,
        sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
        cuda=torch.version.cuda, python=platform.python_version()), tests=args.tests, errors=[])
    torch.manual_seed(0)
    steps = [
        ("bandwidth", lambda: measure_bandwidth()),
        ("decode", lambda: bench_decode(report["bandwidth"], args.batch, args.context, args.quick)),
        ("prefill", lambda: [bench_prefill(4, 0, 2048, args.quick), bench_prefill(4, 3584, 512, args.quick)]),
    ]
    for name, step in steps:
        try:
            report[name] = step()
        except Exception:
            report["errors"].append(f"{name}: {traceback.format_exc()[-2000:]}")
        torch.cuda.empty_cache()
        print(f"{name}: done", flush=True)
    text = render(report)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
