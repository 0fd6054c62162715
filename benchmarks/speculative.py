"""Speculative decoding: tokens/s, acceptance and speedup per method and k, fixed and adaptive.

Two workloads on the default model, each at batch 1 and batch N (16):
- copy:  rewrite a given piece of code with a small edit (rename one identifier); the answer
         copies most of the prompt, so n-gram lookup proposes well. Greedy.
- story: an open-ended short story; little to copy. Sampled (temperature 0.8, top-p 0.95,
         one seed per request), so with n-gram speculation the very same tokens come out
         (point-mass verification draws with plain decoding's noise) and every row of the
         table does the same work.

Rows: no speculation, then n-gram with k fixed (speculating whenever a proposal exists), then
n-gram adaptive (the controller picks 0..k each step), and the same for a draft model when
--draft-model is given (k <= 4; `--draft-model self --draft-quantization int8` drafts with a
quantized copy of the target). Tokens/s counts generated tokens over the wall time of the whole batch,
prefill included; the machine is shared, so the plain and adaptive rows are run several times,
alternating, and their medians compared; tokens per CPU-second of this process are shown too. One model load serves every row: the engine's speculative decoder is
swapped between rows.

    /tmp/tools/quiet .venv/bin/python benchmarks/speculative.py --num-threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tessera import SamplingParams
from tessera.config import DEFAULT_MODEL, EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.spec.decoder import SpeculativeDecoder
from tessera.spec.draft import DraftProposer

SNIPPETS = [
    ("merge_sorted", "merge_lists", '''def merge_sorted(left, right):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
'''),
    ("capacity", "max_size", '''class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)
'''),
    ("binary_search", "find_index", '''def binary_search(values, target):
    low, high = 0, len(values) - 1
    while low <= high:
        middle = (low + high) // 2
        if values[middle] == target:
            return middle
        if values[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
'''),
    ("path", "config_path", '''import json

def load_config(path):
    with open(path) as f:
        config = json.load(f)
    if "name" not in config:
        raise ValueError("the config needs a name")
    config.setdefault("retries", 3)
    config.setdefault("timeout", 30)
    return config
'''),
]

STORY_TOPICS = [
    "a dragon who learns to cook", "a lighthouse keeper and a storm", "a robot that wants to paint",
    "a lost cat finding its way home", "two friends building a raft", "a girl who can talk to trees",
    "the last day of summer camp", "a baker who bakes for the moon", "a detective mouse",
    "a city under the sea", "an old clock that stops time", "a knight afraid of the dark",
    "a garden that grows at night", "a boy and his kite", "a ship made of ice", "a town with no music",
]


def chat_prompt(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def workload(engine: LLMEngine, name: str, batch: int, max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    requests = []
    for i in range(batch):
        if name == "copy":
            old, new, code = SNIPPETS[i % len(SNIPPETS)]
            text = f"Rewrite this Python code, renaming `{old}` to `{new}`. Reply with the full code only.\n\n{code}"
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        else:
            text = f"Write a short story about {STORY_TOPICS[i % len(STORY_TOPICS)]}."
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=1000 + i)
        requests.append((chat_prompt(engine, text), params))
    return requests


_draft_models: dict[tuple[str, str], torch.nn.Module] = {}


def set_speculation(engine: LLMEngine, method: str | None, k: int, adaptive: bool, draft_model: str | None,
                    draft_quantization: str = "none") -> None:
    """Give the engine a fresh speculative decoder (or none): a new controller learns from zero.
    A draft model is loaded once and gets a fresh KV pool per row."""
    if method is None:
        engine.spec = None
        return
    proposer = None
    if method == "draft":
        key = (draft_model, draft_quantization)
        if key not in _draft_models:
            path = engine.config.model if draft_model == "self" else draft_model
            _draft_models[key] = DraftProposer.load(path, engine.dtype, 2, engine.config.block_size,
                                                    quantization=draft_quantization).model
        proposer = DraftProposer(_draft_models[key], engine.kv.num_blocks, engine.config.block_size)
    engine.spec = SpeculativeDecoder(method, k, adaptive, engine.kv, engine.max_model_len, proposer)


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    start = time.perf_counter()
    cpu_start = time.process_time()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    stats = engine.stats()
    tokens = sum(len(t) for t in outputs.values())
    steps = stats.spec_num_steps_on + stats.spec_num_steps_off
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu,
            "acceptance": stats.spec_acceptance_rate, "mean_accepted": stats.spec_mean_accepted_length,
            "steps_on_frac": stats.spec_num_steps_on / steps if steps else 0.0, "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workloads", default="copy,story")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--ks", default="4,8,16", help="fixed k rows at batch 1; adaptive uses the largest as its maximum")
    ap.add_argument("--batched-ks", default="2",
                    help="fixed k rows at batch > 1 (a verify of batch x (k+1) tokens is slow on a CPU: keep few)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batched-max-tokens", type=int, default=64, help="max tokens per request at batch > 1")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the plain and adaptive rows (median kept)")
    ap.add_argument("--draft-model", default=None,
                    help="also run --speculative-method draft with this model (self: the target itself)")
    ap.add_argument("--draft-quantization", default="none", help="quantization of the draft model, e.g. int8")
    ap.add_argument("--methods", default="ngram,draft", help="speculative methods to run (draft needs --draft-model)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--out", default="results/speculative.json")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    batched_ks = [int(k) for k in args.batched_ks.split(",") if k]
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.num_threads))

    def rows_for(batch: int) -> list[tuple[str | None, int, bool]]:
        methods: list[tuple[str | None, int, bool]] = [(None, 0, False)]
        for method in [m for m in args.methods.split(",") if m != "draft" or args.draft_model]:
            fixed = ks if batch == 1 else batched_ks
            if method == "draft":
                fixed = [k for k in fixed if k <= 4]
            methods += [(method, k, False) for k in fixed] + [(method, max(ks), True)]
        return methods

    run(engine, workload(engine, "copy", 1, 8))  # warm-up: first-call allocations, caches
    rows = []
    header = f"{'workload':8} {'batch':>5} {'method':8} {'k':>3} {'mode':8} {'tok/s':>7} {'accept':>6} " \
             f"{'acc/ver':>7} {'spec on':>7} {'speedup':>7} {'cpu':>6}"
    print(header)
    print("-" * len(header))
    for name in args.workloads.split(","):
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            requests = workload(engine, name, batch, args.max_tokens if batch == 1 else args.batched_max_tokens)
            configs = rows_for(batch)
            runs: list[list[dict]] = [[] for _ in configs]
            for i, (method, k, adaptive) in enumerate(configs):
                set_speculation(engine, method, k, adaptive, args.draft_model, args.draft_quantization)
                runs[i].append(run(engine, requests))
            # The machine is shared and its load drifts: plain and adaptive get more runs,
            # alternating, and their medians are compared.
            for _ in range(args.repeats - 1):
                for i, (method, k, adaptive) in enumerate(configs):
                    if method is None or adaptive:
                        set_speculation(engine, method, k, adaptive, args.draft_model, args.draft_quantization)
                        runs[i].append(run(engine, requests))
            results = [sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2] for r in runs]
            baseline = results[0]
            for (method, k, adaptive), r in zip(configs, results, strict=True):
                same = r["outputs"] == baseline["outputs"]
                row = {"workload": name, "batch": batch, "method": method or "none", "k": k,
                       "mode": "adaptive" if adaptive else ("fixed" if method else "-"),
                       "speedup": r["tokens_per_s"] / baseline["tokens_per_s"],
                       "cpu_speedup": r["tokens_per_cpu_s"] / baseline["tokens_per_cpu_s"], "same_tokens": same,
                       "runs": len(runs[configs.index((method, k, adaptive))]),
                       **{key: v for key, v in r.items() if key != "outputs"}}
                rows.append(row)
                print(f"{name:8} {batch:>5} {row['method']:8} {k or '-':>3} {row['mode']:8} "
                      f"{r['tokens_per_s']:>7.1f} {r['acceptance']:>6.2f} {r['mean_accepted']:>7.2f} "
                      f"{r['steps_on_frac']:>7.0%} {row['speedup']:>6.2f}x {row['cpu_speedup']:>5.2f}x"
                      + ("" if same else "  (tokens differ)"), flush=True)
    print(f"\nnone and adaptive: median of {args.repeats} alternating runs. speedup: tok/s over none's; cpu: the "
          "same in tokens per CPU-second of this process (insensitive to other load on the machine). "
          "acc/ver: accepted proposals per verification; spec on: share of decode steps that speculated.")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
