"""The benchmarks' requests: `--dataset-name random` (random token ids of exactly `--input-len`
tokens) or `sharegpt` (`--dataset-path`, a ShareGPT-shaped JSON file), as vLLM's benchmarks
take them.

ShareGPT shape: a JSON list of conversations, each `{"conversations": [{"from": "human",
"value": "..."}, {"from": "gpt", "value": "..."}, ...]}` ("user"/"assistant" and a "messages"
list of {"role", "content"} are read too). The first turn is the prompt; the reply's length in
tokens is the output length unless `--output-len` fixes it. As in vLLM, pairs with a prompt or
reply under 4 tokens, or longer than the model's context together, are left out.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MIN_TOKENS = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def add_dataset_arguments(p: argparse.ArgumentParser, *, input_len: int = 128, output_len: int | None = 128,
                          num_prompts: int = 64, seed: bool = True) -> None:
    """The dataset flags; seed=False where the parser has a --seed already (the engine's)."""
    p.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random",
                   help="random: token ids of exactly --input-len; sharegpt: prompts from --dataset-path")
    p.add_argument("--dataset-path", default=None, help="a ShareGPT-shaped JSON file (--dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=num_prompts, help="requests to run")
    p.add_argument("--input-len", type=int, default=input_len, help="prompt tokens per request (random)")
    p.add_argument("--output-len", type=int, default=output_len,
                   help="tokens generated per request (ignore_eos); sharegpt default: each reply's length")
    if seed:
        p.add_argument("--seed", type=int, default=0)


def random_token_prompts(n: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`n` prompts of `input_len` token ids, away from the special ids at both ends of the vocabulary."""
    rng = random.Random(seed)
    lo, hi = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size * 3 // 4)
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(n)]


def _turns(item: dict) -> list[str]:
    turns = item.get("conversations") or item.get("messages") or []
    return [t.get("value", t.get("content", "")) for t in turns if isinstance(t, dict)]


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, reply) text pairs of a ShareGPT-shaped file, in file order."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--dataset-path {path}: {exc}") from exc
    if not isinstance(data, list):
        raise SystemExit(f"--dataset-path {path}: expected a JSON list of conversations (ShareGPT shape)")
    pairs = [(turns[0], turns[1]) for item in data if isinstance(item, dict) and len(turns := _turns(item)) >= 2]
    if not pairs:
        raise SystemExit(f"--dataset-path {path}: no conversation with a prompt and a reply "
                         "(each item needs 'conversations': [{'from', 'value'}, ...])")
    return pairs


def sample_requests(args: argparse.Namespace, encode: Callable[[str], list[int]], vocab_size: int,
                    max_model_len: int) -> list[BenchRequest]:
    """The run's requests from the dataset flags; `encode` tokenizes text (sharegpt only)."""
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be >= 1")
    if args.output_len is not None and args.output_len < 1:
        raise SystemExit("--output-len must be >= 1")
    if args.dataset_name == "random":
        if args.input_len < 1:
            raise SystemExit("--input-len must be >= 1")
        out_len = args.output_len or 128
        if args.input_len + out_len > max_model_len:
            raise SystemExit(f"--input-len {args.input_len} + --output-len {out_len} exceeds the model's context of "
                             f"{max_model_len} tokens (--max-model-len)")
        prompts = random_token_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
        return [BenchRequest(p, out_len) for p in prompts]
    if not args.dataset_path:
        raise SystemExit("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-shaped JSON list)")
    pairs = read_sharegpt(args.dataset_path)
    random.Random(args.seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        ids = encode(prompt)
        out_len = args.output_len or len(encode(reply))
        if len(ids) < MIN_TOKENS or out_len < MIN_TOKENS or len(ids) + out_len > max_model_len:
            continue
        out.append(BenchRequest(ids, out_len))
        if len(out) == args.num_prompts:
            break
    if not out:
        raise SystemExit(f"--dataset-path {args.dataset_path}: no conversation fits the model's context of "
                         f"{max_model_len} tokens with prompt and reply of at least {MIN_TOKENS} tokens")
    return out
