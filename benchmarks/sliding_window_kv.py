"""KV blocks in use over a long run of a sliding-window model: a table, not a test.

A tiny random Mistral (the window is what matters, not the weights) reads one --prompt-len
prompt in --chunk-token chunks and decodes --new-tokens; after every step the engine's stats
give the blocks in use. Prints the peak next to the bound window + one chunk and the blocks the
whole context would take without the window.

    python benchmarks/sliding_window_kv.py --prompt-len 32768 --window 4096 --chunk 512
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.config import EngineConfig  # noqa: E402
from tessera.engine.engine import LLMEngine  # noqa: E402
from tessera.sampling import SamplingParams  # noqa: E402
from tests.tiny_model import make_tiny_model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=400)
    args = ap.parse_args()
    bs = args.block_size
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model_dir(Path(tmp), model_type="mistral", sliding_window=args.window, num_layers=2,
                                   hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                                   max_position_embeddings=2 * args.prompt_len)
        bytes_per_block = bs * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=bs,
                                        kv_cache_memory=args.pool_blocks * bytes_per_block,
                                        max_num_batched_tokens=args.chunk, max_model_len=2 * args.prompt_len))
        prompt = torch.randint(0, 250, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        engine.add_request("long", prompt, SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True))
        peak = steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.stats()
            peak = max(peak, stats.num_total_blocks - stats.num_free_blocks)
            steps += 1
    total = args.prompt_len + args.new_tokens
    print(f"{'tokens':>7} {'window':>6} {'chunk':>5} {'steps':>5} {'peak blocks':>11} {'bound':>5} "
          f"{'pool':>5} {'no window':>9}")
    print(f"{total:>7} {args.window:>6} {args.chunk:>5} {steps:>5} {peak:>11} "
          f"{-(-(args.window + args.chunk) // bs) + 2:>5} {engine.kv.num_usable_blocks:>5} {-(-total // bs):>9}")


if __name__ == "__main__":
    main()
