"""The whole engine on an NVIDIA GPU: decode steps from CUDA graphs against eager, tokens and speed.

For each model shape (random weights in bf16, written as an HF folder by the tests' tiny-model
writer, whose tokenizer has 267 tokens: the lm_head is negligible here, unlike a real model's),
three engines in turn on the same prompts: `enforce_eager=True` (every kernel launched from
Python), the default (decode steps replayed from CUDA graphs, tessera/engine/cuda_graphs.py),
and the default with the layers' fused elementwise kernels hidden (their torch ops instead:
tessera/kernels/triton_elementwise.py):
  - start-up: LLM(...) to ready, graph capture included;
  - greedy tokens of both, compared (bf16: a near tie may flip; the fp32 parity test is
    tests/unit/test_decode_graphs.py, which run.sh runs on the GPU);
  - one stream: a 128-token prompt, 128 tokens out: ms per output token after the first;
  - a batch: N prompts of 128 tokens, 128 out each, submitted together: output tokens/s.
Prints a table and writes markdown and JSON.

    python benchmarks/gpu/engine_check.py --out benchmarks/gpu/ENGINE.md --json benchmarks/gpu/engine.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tessera import LLM, SamplingParams  # noqa: E402
from tessera.kernels import triton_elementwise  # noqa: E402
from tests.tiny_model import make_tiny_model_dir  # noqa: E402

_usable = triton_elementwise.usable
SHAPES = {
    # name: (layers, hidden, heads, kv heads, head_dim, intermediate)
    "smollm2-135m-shape": (30, 576, 9, 3, 64, 1536),
    "llama-3.2-1b-shape": (16, 2048, 32, 8, 64, 8192),
}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 3, (length,), generator=gen).tolist() for _ in range(n)]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


MODES = (  # (label, enforce_eager, the layers' fused Triton elementwise kernels)
    ("eager", True, True),
    ("cuda graphs", False, True),
    ("cuda graphs, unfused elementwise", False, False),
)


def measure(model_dir: Path, mode: tuple[str, bool, bool], args) -> dict:
    label, eager, fused = mode
    # The unfused mode hides the kernels from the layers, which then run their torch ops.
    triton_elementwise.usable = _usable if fused else (lambda x: False)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, enforce_eager=eager, max_model_len=1024,
              max_num_seqs=args.batch, kv_cache_memory=args.kv_gib << 30, max_num_batched_tokens=8192)
    startup = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    graphs = llm.engine.runner.decode_graphs
    # Warm-up at the measured prompt length: Triton compiles a kernel again for new integer
    # specialisations (a length divisible by 16, say), which would land in the first timing.
    _generate(llm, _prompts(1, args.prompt_len, vocab, 1), 8)
    _generate(llm, _prompts(args.batch, args.prompt_len, vocab, 1), 8)
    one_prompt = _prompts(1, args.prompt_len, vocab, 2)
    s_first, _ = _generate(llm, one_prompt, 1)
    s_all, one_tokens = _generate(llm, one_prompt, args.output_len)
    tpot_ms = (s_all - s_first) / (args.output_len - 1) * 1e3
    batch_prompts = _prompts(args.batch, args.prompt_len, vocab, 3)
    s_batch, batch_tokens = _generate(llm, batch_prompts, args.output_len)
    result = {
        "mode": label,
        "graph sizes": graphs.sizes if graphs is not None else None,
        "startup s": round(startup, 2),
        "one-stream TTFT ms": round(s_first * 1e3, 2),
        "one-stream ms/token": round(tpot_ms, 3),
        "one-stream tok/s": round(1e3 / tpot_ms, 1),
        f"batch {args.batch} out tok/s": round(args.batch * args.output_len / s_batch, 1),
        f"batch {args.batch} s": round(s_batch, 3),
        "tokens": one_tokens + batch_tokens,
    }
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {sorted(SHAPES)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-gib", type=int, default=8)
    parser.add_argument("--layers", type=int, default=None, help="override every shape's layer count (smoke runs)")
    parser.add_argument("--out", default=None, help="markdown report")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    header = (f"{device_name}, torch {torch.__version__}, {args.dtype}, random weights, prompts of "
              f"{args.prompt_len} tokens, {args.output_len} out, batch {args.batch}")
    print(header, flush=True)
    rows, report = [], {"device": device_name, "torch": torch.__version__, "args": vars(args), "shapes": {}}
    for name in args.shapes.split(","):
        layers, hidden, heads, kv_heads, head_dim, inter = SHAPES[name]
        t0 = time.perf_counter()
        model_dir = make_tiny_model_dir(Path(tempfile.mkdtemp(prefix=name)), num_layers=args.layers or layers,
                                        hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                        intermediate_size=inter, tie_word_embeddings=True, dtype=torch.bfloat16,
                                        max_position_embeddings=4096)
        print(f"{name}: model written in {time.perf_counter() - t0:.1f}s", flush=True)
        results = []
        for mode in MODES:
            try:
                results.append(measure(model_dir, mode, args))
            except Exception as exc:  # noqa: BLE001 - report and go on to the next case
                results.append({"mode": mode[0], "error": f"{type(exc).__name__}: {exc}"})
            shown = {k: v for k, v in results[-1].items() if k != "tokens"}
            print(f"  {shown}", flush=True)
        a = results[0].get("tokens")
        for r in results[1:]:
            b = r.get("tokens")
            if a is None or b is None:
                continue
            same = sum(x == y for x, y in zip(a, b, strict=True))
            agree = sum(p == q for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=False)) / sum(len(x) for x in a)
            r["sequences identical to eager"] = f"{same}/{len(a)}"
            r["token agreement with eager"] = round(agree, 4)
        for r in results:
            r.pop("tokens", None)
        report["shapes"][name] = results
        rows.append((name, results))

    lines = [f"# The engine on {device_name}: CUDA graphs against eager", "", header + ".", "",
             "Written by `benchmarks/gpu/engine_check.py` (run by `benchmarks/gpu/run.sh`); nothing here is typed "
             "by hand.", ""]
    keys = [k for k in ("startup s", "one-stream TTFT ms", "one-stream ms/token", "one-stream tok/s",
                        f"batch {args.batch} out tok/s", "sequences identical to eager", "token agreement with eager",
                        "graph sizes", "error")]
    lines += ["| shape | mode | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for name, results in rows:
        for r in results:
            cells = [str(r.get(k, "")) for k in keys]
            if r.get("graph sizes"):
                cells[keys.index("graph sizes")] = f"{len(r['graph sizes'])} sizes, up to {r['graph sizes'][-1]}"
            lines.append(f"| {name} | {r['mode']} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
