"""Batch-1 weight-only GEMV speed of each quantized kernel, in GB/s of weights read, next to the
machine's measured memory bandwidth.

One "token" is every matmul of a decode step of the default model's shape (30 layers of qkv, o,
gate_up, down, and the 49152-row lm_head), random weights, one activation row: each weight is
read once per token, as in a real decode step, and the set is larger than the L2 caches. GB/s =
weight bytes (as stored: codes, scales, zero points) / seconds per token. Bandwidth is
roofline.py's: the best of a large copy and a large sum.

    /tmp/tools/quiet python benchmarks/gemv.py --threads 1
    /tmp/tools/quiet python benchmarks/gemv.py --threads 2 --rows 1,4
    /tmp/tools/quiet python benchmarks/gemv.py --threads 2 --modes int8,int8-torch,q8_0,q8_0-torch --per-shape

"bf16-invariant" is the bf16 engine's own linear (`InvariantLinear`: AMX tiles, or AVX-512 BF16),
"bf16" torch's F.linear on the same weights. A mode with "-torch" builds its layers with
TESSERA_QUANT_INVARIANT=0: the shape-picked torch / AVX-512 kernels that run where the
batch-invariant AMX kernel (tessera/quant/invariant.py) does not; without the suffix the layers
take whatever the machine's default is. `--per-shape` also
prints each weight shape's share (its 30 copies, or the one lm_head) in GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward import timed  # noqa: E402
from machine import cpu_name  # noqa: E402
from roofline import measure_bandwidth  # noqa: E402

from tessera.kernels.linear import InvariantLinear  # noqa: E402
from tessera.quant import native_gemv  # noqa: E402
from tessera.quant.gguf_native import Q8_0Linear  # noqa: E402
from tessera.quant.int4 import Int4Linear  # noqa: E402
from tessera.quant.int8 import Int8Linear  # noqa: E402
from tessera.quant.w8a8 import W8A8Linear  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def shapes(layers: int) -> list[tuple[int, int]]:
    return LAYER_SHAPES * layers + [LM_HEAD]


def build(mode: str, weights: list[torch.Tensor]):
    if mode.endswith("-torch"):
        os.environ["TESSERA_QUANT_INVARIANT"] = "0"
        try:
            return build(mode.removesuffix("-torch"), weights)
        finally:
            del os.environ["TESSERA_QUANT_INVARIANT"]
    if mode == "fp32":
        return weights
    if mode == "bf16":
        return [w.to(torch.bfloat16) for w in weights]
    if mode == "bf16-invariant":  # the bf16 engine's own linears (AMX tiles / AVX-512 BF16)
        return [InvariantLinear(w.to(torch.bfloat16)) for w in weights]
    if mode == "int8":
        return [Int8Linear.from_float(w) for w in weights]
    if mode == "w8a8":
        return [W8A8Linear.from_float(w) for w in weights]
    if mode == "int4":  # also GGUF Q4_0 / Q4_1, which load into this format
        return [Int4Linear.from_float(w, 32) for w in weights]
    if mode == "q8_0":
        out = []
        for w in weights:
            d = (w.view(w.shape[0], -1, 32).abs().amax(-1) / 127).clamp_min(1e-8).half()
            codes = torch.round(w.view(w.shape[0], -1, 32) / d.float()[..., None]).clamp(-127, 127).to(torch.int8)
            out.append(Q8_0Linear(codes.view_as(w), d.float()))
        return out
    raise ValueError(mode)


def run_layers(layers, xs: dict[int, torch.Tensor], mode: str, kernel: str) -> None:
    """Every layer once on the activation of its input width (the mode picks how a layer is called)."""
    if mode in ("fp32", "bf16"):
        for w in layers:
            F.linear(xs[w.shape[1]], w)
    elif mode == "bf16-invariant":
        for layer in layers:
            layer(xs[layer.in_features])
    else:
        for layer in layers:
            layer(xs[layer.in_features], kernel=kernel)


def nbytes(layer) -> int:
    return layer.numel() * layer.element_size() if isinstance(layer, torch.Tensor) else layer.weight_bytes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", default="1")
    p.add_argument("--modes", default="fp32,bf16,int8,int4,q8_0")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--per-shape", action="store_true", help="also time each weight shape's layers alone")
    p.add_argument("--act-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the quantized modes' activations (a bf16 engine's are bf16; the fp32 ones take "
                        "the invariant kernel's hi + lo split)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    native = native_gemv.available()
    bw = measure_bandwidth(256, 5)
    bandwidth = max(bw["copy"], bw["read"])
    print(f"{cpu_name()}, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {args.threads} thread(s), native kernels "
          f"{'built' if native else 'NOT available'}; bandwidth: copy {bw['copy'] / 1e9:.1f} GB/s, "
          f"read {bw['read'] / 1e9:.1f} GB/s")
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes(args.layers)]
    results = []
    print(f"{'mode':<14} {'kernel':<9} {'rows':>4} {'MiB/token':>10} {'ms/token':>9} {'GB/s':>7} {'% of bw':>8}")
    for mode in args.modes.split(","):
        layers = build(mode, weights)
        total = sum(nbytes(layer) for layer in layers)
        kernels = (("F.linear",) if mode in ("fp32", "bf16") else ("invariant",) if mode == "bf16-invariant"
                   else layers[0].kernels)
        if mode.endswith("-torch") and "native" in kernels:
            kernels = ("native",)  # the decode kernel the layers pick at M <= 8
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, 576, generator=gen)
            xs = {576: x, 1536: torch.randn(m, 1536, generator=gen)}
            if mode.startswith("bf16") or (mode != "fp32" and args.act_dtype == "bfloat16"):
                xs = {k: v.to(torch.bfloat16) for k, v in xs.items()}
            for kernel in kernels:
                if kernel == "native" and not native:
                    continue
                seconds = timed(partial(run_layers, layers, xs, mode, kernel), 1, args.repeats)
                row = dict(mode=mode, kernel=kernel, rows=m, bytes=total, seconds=seconds,
                           gb_s=total / seconds / 1e9, fraction=total / seconds / bandwidth)
                results.append(row)
                print(f"{mode:<14} {kernel:<9} {m:>4} {total / 2**20:>10.1f} {seconds * 1e3:>9.2f} "
                      f"{row['gb_s']:>7.1f} {100 * row['fraction']:>7.0f}%", flush=True)
                if args.per_shape:
                    for shape in dict.fromkeys(shapes(1)):
                        group = [lay for lay, wt in zip(layers, weights, strict=True) if tuple(wt.shape) == shape]
                        gbytes = sum(nbytes(lay) for lay in group)
                        gs = timed(partial(run_layers, group, xs, mode, kernel), 1, args.repeats)
                        results.append(dict(mode=mode, kernel=kernel, rows=m, shape=shape, copies=len(group),
                                            bytes=gbytes, seconds=gs, gb_s=gbytes / gs / 1e9))
                        print(f"    {shape[0]:>5} x {shape[1]:<5} x{len(group):<3} {gbytes / 2**20:>8.1f} MiB "
                              f"{gs * 1e3:>8.2f} ms {gbytes / gs / 1e9:>6.1f} GB/s "
                              f"{100 * gbytes / gs / bandwidth:>4.0f}%", flush=True)
        del layers
    out = Path(args.out or f"results/gemv_t{args.threads}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "bandwidth": bw, "cpu": cpu_name(),
                               "capability": torch.backends.cpu.get_cpu_capability(), "rows": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
