"""Perplexity of a model (in any quantization mode) over a fixed text shipped with the project.

The text is data/pride_and_prejudice.txt (the opening chapters of Jane Austen's novel, public
domain). Perplexity is computed with a sliding window through the model's own forward pass, so it
measures exactly what the engine runs: windows of `window` tokens start every `stride` tokens, and
each token is scored once, by the first window that holds it past the overlap, so every scored
token (after the first window) sees at least window - stride tokens of context.

    tessera quality --quantization none,int8,int4,w8a8,gguf --quantize-lm-head
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tessera.attention.metadata import single_sequence_metadata
from tessera.config import DEFAULT_MODEL, QUANTIZATION_METHODS, resolve_dtype

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "pride_and_prejudice.txt"
_LOGIT_ROWS = 128  # logits of at most this many rows at once: [128, vocab] float32 stays small


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    num_scored: int
    window: int
    stride: int


@torch.inference_mode()
def perplexity(model, token_ids: list[int], window: int = 512, stride: int = 384,
               block_size: int = 16) -> PerplexityResult:
    """Sliding-window perplexity of `model` (a CausalLM) over `token_ids`: windows of
    `window` tokens every `stride` (< window) tokens, each token but the first scored once."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    if not 0 < stride < window:
        # Windows must overlap by a token at least: a window's first token has no prediction in it.
        raise ValueError(f"stride must be in 1..window - 1 ({window - 1}), got {stride}")
    ids = torch.tensor(token_ids, dtype=torch.long)
    n = ids.numel()
    window = min(window, n)
    kv_caches = model.allocate_kv_cache(1 + -(-window // block_size), block_size)
    total_nll, scored, next_target = 0.0, 0, 1  # token 0 has no prediction
    for start in range(0, n - 1, stride):
        end = min(start + window, n)
        chunk = ids[start:end]
        hidden = model(chunk, torch.arange(end - start), kv_caches, single_sequence_metadata(end - start, block_size))
        # hidden row r predicts token start + r + 1; score the targets no window has scored yet.
        for t0 in range(next_target, end, _LOGIT_ROWS):
            t1 = min(t0 + _LOGIT_ROWS, end)
            logits = model.compute_logits(hidden[t0 - 1 - start : t1 - 1 - start])
            total_nll += float(F.cross_entropy(logits, ids[t0:t1], reduction="sum"))
        scored += end - next_target
        next_target = end
        if end == n:
            break
    mean = total_nll / scored
    return PerplexityResult(math.exp(mean), mean, scored, window, stride)


def load_model(model: str, dtype: str = "float32", quantization: str = "none", quantize_lm_head: bool = False,
               quant_group_size: int = 32):
    """(model, tokenizer) loaded and quantized the way LLMEngine does it, without the engine."""
    from tessera.model.download import resolve_model_path
    from tessera.model.registry import build_model
    from tessera.model.tokenizer import Tokenizer
    from tessera.model.weights import load_model_files

    path = resolve_model_path(model)
    files = load_model_files(path)
    m = build_model(files, resolve_dtype(dtype), quantization=quantization, quantize_lm_head=quantize_lm_head,
                    quant_group_size=quant_group_size)
    return m, Tokenizer(path, files.config)


def text_token_ids(tokenizer, path: str | Path = DEFAULT_TEXT) -> list[int]:
    text = Path(path).read_text(encoding="utf-8")
    return tokenizer.encode(text, add_special_tokens=False)


def add_quality_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, or the default model's name")
    p.add_argument("--dtype", default="float32", help="activation / float weight dtype (float32 | bfloat16)")
    p.add_argument("--quantization", default="none,int8,int4,w8a8,gguf",
                   help=f"comma-separated modes to compare, of {', '.join(QUANTIZATION_METHODS)}")
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize the lm_head too")
    p.add_argument("--quant-group-size", type=int, default=32, help="int4 group size (32, 64 or 128)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file to score")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--stride", type=int, default=384, help="tokens between window starts")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")


def cmd_quality(args: argparse.Namespace) -> int:
    from tessera.quant import weight_memory_bytes

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    modes = [m.strip() for m in args.quantization.split(",") if m.strip()]
    print(f"{'mode':<8} {'weights MiB':>11} {'perplexity':>10} {'vs none':>8} {'tokens':>6} {'seconds':>7}")
    baseline = None
    for mode in modes:
        model, tokenizer = load_model(args.model, args.dtype, mode, args.quantize_lm_head, args.quant_group_size)
        ids = text_token_ids(tokenizer, args.text)
        start = time.perf_counter()
        result = perplexity(model, ids, args.window, args.stride)
        seconds = time.perf_counter() - start
        if mode == "none":
            baseline = result.perplexity
        rel = f"{100 * (result.perplexity / baseline - 1):+.2f}%" if baseline else "-"
        print(f"{mode:<8} {weight_memory_bytes(model) / 2**20:>11.1f} {result.perplexity:>10.3f} {rel:>8} "
              f"{result.num_scored:>6} {seconds:>7.1f}", flush=True)
    return 0
