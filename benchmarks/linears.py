"""Time the linear layers of one model step as the engine runs them, at a few row counts.

All of a step's linears (qkv, o, gate_up, down per layer, then the lm_head) of the default model's
shape (SmolLM2-135M, random weights, benchmarks/forward.py's model) in the kernels the engine
picks (`prepare_step_kernels`: the batch-invariant kernel for bf16, AMX tiles or AVX-512 BF16),
called back to back on an M-row input, as a decode step of batch M calls them. Prints, per M, the
median and min milliseconds, the weight bytes read per millisecond (GB/s) and the FLOP rate, and
writes JSON. Compare GB/s with a copy's bandwidth (benchmarks/roofline.py).

    /tmp/tools/quiet python benchmarks/linears.py --rows 1,16,32,64
    /tmp/tools/quiet python benchmarks/linears.py --rows 1,8,32,256,512 --against-onednn
    python benchmarks/linears.py --rows 32,256 --per-shape   # also each kind of linear alone (layer 0's)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from forward import build_model
from machine import cpu_name

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,16,32", help="comma-separated M values")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--against-onednn", action="store_true",
                    help="also time F.linear (oneDNN / MKL) on weights of the same shapes, alternating per repeat")
    ap.add_argument("--per-shape", action="store_true",
                    help="also time layer 0's qkv, o, gate_up, down and the lm_head alone (median us per call; a "
                         "layer's weights then stay in cache)")
    ap.add_argument("--out", default=str(HERE / "results" / "linears.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = build_model("random", dtype, seed=0)
    weights = [w for layer in model.layers for w in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    weights.append(model.lm_head)
    shapes = [(w.out_features, w.in_features) if hasattr(w, "in_features") else tuple(w.shape) for w in weights]
    weight_bytes = sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8
    from tessera.model.layers import linear

    # --against-onednn: plain weights of the same shapes (the model's are packed for its kernels).
    plain = [torch.randn(n, k).to(dtype) for n, k in shapes] if args.against_onednn else []

    rows = []
    for m in (int(v) for v in args.rows.split(",")):
        inputs = {k: torch.randn(m, k, dtype=dtype) for _, k in shapes}

        def step(m_inputs=inputs) -> None:
            for w, (_, k) in zip(weights, shapes, strict=True):
                linear(m_inputs[k], w)

        def onednn_step(m_inputs=inputs) -> None:
            for w, (_, k) in zip(plain, shapes, strict=True):
                torch.nn.functional.linear(m_inputs[k], w)

        for _ in range(3):
            step()
            if args.against_onednn:
                onednn_step()
        times, onednn_times = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            if args.against_onednn:
                start = time.perf_counter()
                onednn_step()
                onednn_times.append(time.perf_counter() - start)
        med, best = statistics.median(times), min(times)
        flops = 2 * m * weight_bytes / (torch.finfo(dtype).bits // 8)
        rows.append(dict(rows=m, ms_median=med * 1e3, ms_min=best * 1e3, gb_s_median=weight_bytes / med / 1e9,
                         tflop_s_median=flops / med / 1e12))
        r = rows[-1]
        line = (f"M={m:4d}  {r['ms_median']:7.2f} ms (min {r['ms_min']:.2f})  {r['gb_s_median']:5.1f} GB/s  "
                f"{r['tflop_s_median']:.2f} TFLOP/s  ({len(weights)} linears, {weight_bytes / 1e6:.0f} MB)")
        if onednn_times:
            r["onednn_ms_median"] = statistics.median(onednn_times) * 1e3
            line += f"  F.linear {r['onednn_ms_median']:7.2f} ms ({r['onednn_ms_median'] / r['ms_median']:.2f}x)"
        print(line, flush=True)
        if args.per_shape:
            kinds = zip(["qkv", "o", "gate_up", "down", "lm_head"], weights[:4] + weights[-1:], shapes[:4] + shapes[-1:],
                        strict=True)
            r["per_shape_us"] = per_shape(kinds, m, dtype, args.repeats)
            print("        " + "  ".join(f"{k} {v:.0f} us" for k, v in r["per_shape_us"].items()), flush=True)
    out = dict(cpu=cpu_name(), threads=args.threads, dtype=args.dtype,
               weight_bytes=weight_bytes, results=rows)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


def per_shape(kinds, m: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Median microseconds of each (name, weight, (n, k)) linear called alone on an m-row input
    (after 5 warm calls)."""
    from tessera.model.layers import linear

    result = {}
    for name, w, (_, k) in kinds:
        x = torch.randn(m, k, dtype=dtype)
        for _ in range(5):
            linear(x, w)
        times = []
        for _ in range(repeats * 5):
            start = time.perf_counter()
            linear(x, w)
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times) * 1e6
    return result


if __name__ == "__main__":
    main()
