"""Where Tessera's decode time goes next to the floor the competitors run close to (Tessera's venv).

1. one decode step at batch 1 and batch 32 (context 256), torch profiler: time per op kind and the
   number of ops launched per step;
2. the matmuls alone: each layer's F.linear shapes at batch 1 and 32 on the model's own weights,
   plus the lm_head (tied embedding, 49152 x 576);
3. the memory floor: bytes of weights read per step / memory bandwidth (a large tensor copy).

    /tmp/tools/quiet .venv/bin/python benchmarks/competitors/profile_tessera.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from throughput import make_prompts  # noqa: E402

from tessera import LLM, SamplingParams  # noqa: E402

KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"),
    "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::baddbmm", "aten::softmax",
                  "aten::_softmax"),
    "kv write / gather": ("aten::index_put", "aten::index_select", "aten::index", "aten::gather",
                          "aten::scatter", "aten::index_copy"),
    "norm / rotary / silu / add": ("aten::rms_norm", "aten::_fused_rms_norm", "aten::mul", "aten::addcmul",
                                   "aten::add", "aten::silu", "aten::pow", "aten::rsqrt", "aten::mean"),
    "copies / views": ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::empty",
                       "aten::view", "aten::slice", "aten::split", "aten::select", "aten::unsqueeze",
                       "aten::as_strided", "aten::reshape", "aten::cat", "aten::transpose", "aten::expand"),
    "sampling": ("aten::argmax", "aten::max", "aten::topk", "aten::sort"),
}


def kind_of(key: str) -> str:
    for kind, prefixes in KINDS.items():
        if key.startswith(prefixes):
            return kind
    return "other"


def profile_decode(llm: LLM, batch: int, context: int, steps: int) -> dict:
    engine = llm.engine
    prompts = make_prompts(batch, context, engine.model_config.vocab_size, seed=3 + batch)
    params = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"prof-{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens
              for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    for _ in range(2):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain_ms = 1000 * (time.perf_counter() - t0) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    engine.abort_request(ids)
    by_kind: dict[str, float] = defaultdict(float)
    calls = 0
    top = []
    for evt in prof.key_averages():
        if not evt.key.startswith("aten::"):
            continue
        by_kind[kind_of(evt.key)] += evt.self_cpu_time_total / 1000 / steps
        calls += evt.count
        top.append((evt.self_cpu_time_total / 1000 / steps, evt.count / steps, evt.key))
    top.sort(reverse=True)
    return {"batch": batch, "context": context, "step_ms": plain_ms,
            "aten_ops_per_step": calls / steps,
            "self_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top_ops": [{"op": k, "self_ms": round(ms, 2), "calls": round(c)} for ms, c, k in top[:12]]}


def time_it(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def matmuls_alone(llm: LLM, batch: int) -> dict:
    model = llm.engine.runner.model
    layers = model.layers
    hidden = model.config.hidden_size
    x = torch.randn(batch, hidden)
    xi = torch.randn(batch, model.config.intermediate_size)
    xo = torch.randn(batch, model.config.num_heads * model.config.head_dim)

    def all_layers():
        for layer in layers:
            F.linear(x, layer.self_attn.qkv_proj)
            F.linear(xo, layer.self_attn.o_proj)
            F.linear(x, layer.mlp.gate_up_proj)
            F.linear(xi, layer.mlp.down_proj)

    layers_ms = 1000 * time_it(all_layers, 5)
    head_ms = 1000 * time_it(lambda: F.linear(x, model.lm_head), 5)
    return {"batch": batch, "layer_linears_ms": layers_ms, "lm_head_ms": head_ms, "calls": 4 * len(layers) + 1}


def memory_floor(llm: LLM) -> dict:
    model = llm.engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    big = torch.empty(256 * 2**20 // 4)  # 256 MiB
    big.uniform_()
    dst = torch.empty_like(big)
    seconds = time_it(lambda: dst.copy_(big), 5)
    bandwidth = 2 * big.numel() * 4 / seconds  # read + write
    return {"weight_bytes": weight_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9,
            "floor_ms_per_step": 1000 * weight_bytes / bandwidth}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "profile_tessera.json"))
    args = ap.parse_args()
    llm = LLM(num_threads=args.threads, max_num_batched_tokens=512, max_num_seqs=64)
    result = {"threads": torch.get_num_threads(), "memory": memory_floor(llm),
              "decode": [profile_decode(llm, b, 256, args.steps) for b in (1, 32)],
              "matmuls_alone": [matmuls_alone(llm, b) for b in (1, 32)]}
    m = result["memory"]
    print(f"weights {m['weight_bytes'] / 2**20:.0f} MiB, copy bandwidth {m['copy_bandwidth_gb_s']:.1f} GB/s, "
          f"floor {m['floor_ms_per_step']:.1f} ms per decode step")
    for d in result["decode"]:
        print(f"\ndecode batch {d['batch']} ctx {d['context']}: {d['step_ms']:.1f} ms/step, "
              f"{d['aten_ops_per_step']:.0f} aten ops/step")
        for k, ms in d["self_ms_by_kind"].items():
            print(f"  {k:28s} {ms:7.2f} ms")
        for t in d["top_ops"]:
            print(f"    {t['op']:40s} {t['self_ms']:7.2f} ms {t['calls']:5d} calls")
    for mm in result["matmuls_alone"]:
        print(f"\nmatmuls alone, batch {mm['batch']}: 120 layer linears {mm['layer_linears_ms']:.1f} ms, "
              f"lm_head {mm['lm_head_ms']:.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
