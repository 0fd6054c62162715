"""Prefix caching: what it saves on shared prompts and conversations, what it costs without them,
and (with --swap) swap against recompute preemption.

Workloads (token ids drawn at random, greedy, ignore_eos, every request submitted at once):
- shared:  N requests = one S-token system prompt + U unique tokens each, O output tokens each;
           caching off vs on: wall time, mean and p50 TTFT, hit rate.
- unique:  the same shape with no shared prefix: the cost of hashing and cache bookkeeping when
           nothing hits. Runs alternate off/on for R rounds (best wall time of each), and the time
           spent inside KVCacheManager calls is measured directly, since on a shared machine the
           wall time of identical runs can vary by more than the bookkeeping costs.
- convo:   T turns of one conversation, turn k+1 = turn k's prompt + its output + U new tokens;
           the hit rate and TTFT of each turn, caching off vs on. Token ids are carried over as
           generated (no re-tokenization of the reply), the best case a server that keeps them gets.
- swap (--swap): requests that outgrow a small KV pool, so sequences are preempted; recompute
           vs swap to the host KV tier, prefix caching off (so recompute really recomputes).

    flock /tmp/tessera-bench.lock python benchmarks/prefix.py [--swap]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from tessera import SamplingParams
from tessera.config import DEFAULT_MODEL, EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.engine_args import parse_memory


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


KV_CALLS = ("allocate_for_admission", "allocate_slots", "commit_computed", "free")


def time_kv_calls(engine: LLMEngine) -> dict[str, float]:
    """Wrap the engine's KVCacheManager calls with timers; returns the running totals (seconds)."""
    totals = dict.fromkeys(KV_CALLS, 0.0)
    for name in KV_CALLS:
        fn = getattr(engine.kv, name)

        def timed(*args, _fn=fn, _name=name):
            t0 = time.perf_counter()
            result = _fn(*args)
            totals[_name] += time.perf_counter() - t0
            return result

        setattr(engine.kv, name, timed)
    return totals


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    """Submit every prompt at once, step to the end; wall time, TTFTs and this run's hit rate."""
    before = engine.stats()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    arrival = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params, arrival_time=arrival)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    wall = time.perf_counter() - start
    after = engine.stats()
    assert len(finished) == len(prompts) and all(len(o.outputs[0].token_ids) == output_len for o in finished)
    ttfts = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in finished)
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {
        "wall_s": wall,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "hit_rate": hits / queries if queries else 0.0,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "swapped_out_blocks": after.num_swapped_out_blocks - before.num_swapped_out_blocks,
        "swapped_in_blocks": after.num_swapped_in_blocks - before.num_swapped_in_blocks,
        "outputs": {o.request_id: o.outputs[0].token_ids for o in finished},
    }


def run_conversation(engine: LLMEngine, first_prompt: list[int], turns: int, user_len: int, output_len: int,
                     rng: random.Random, vocab: int) -> list[dict]:
    prompt, rows = list(first_prompt), []
    for turn in range(1, turns + 1):
        r = run_batch(engine, [prompt], output_len)
        rows.append({"turn": turn, "prompt_tokens": len(prompt), "hit_rate": r["hit_rate"], "ttft_s": r["ttft_mean_s"],
                     "wall_s": r["wall_s"], "output": r["outputs"]["b0"]})
        prompt = prompt + r["outputs"]["b0"] + random_tokens(rng, user_len, vocab)
    return rows


def make_engine(args, **kw) -> LLMEngine:
    cfg = dict(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
               max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
               num_threads=args.num_threads)
    engine = LLMEngine(EngineConfig(**(cfg | kw)))
    run_batch(engine, [random_tokens(random.Random(99), 40, engine.model_config.vocab_size)], 4)  # warm-up
    return engine


def strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "outputs"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--unique-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="off/on rounds of the no-shared-prefix workload")
    ap.add_argument("--kv-cache-memory", type=parse_memory, default="1GiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--swap", action="store_true", help="also compare recompute and swap preemption")
    ap.add_argument("--swap-requests", type=int, default=16)
    ap.add_argument("--swap-prompt-len", type=int, default=128)
    ap.add_argument("--swap-output-len", type=int, default=96)
    ap.add_argument("--swap-kv-tokens", type=int, default=1024, help="device KV pool of the swap run, in tokens")
    ap.add_argument("--out", default="results/prefix.json")
    args = ap.parse_args()

    engines = {caching: make_engine(args, enable_prefix_caching=caching) for caching in (False, True)}
    vocab = engines[True].model_config.vocab_size
    rng = random.Random(0)
    n, s, u, o = args.num_requests, args.system_len, args.unique_len, args.output_len

    system = random_tokens(rng, s, vocab)
    shared_prompts = [system + random_tokens(rng, u, vocab) for _ in range(n)]
    shared = {c: run_batch(engines[c], shared_prompts, o) for c in (False, True)}
    same_outputs = shared[False]["outputs"] == shared[True]["outputs"]

    unique_runs: dict[bool, list[dict]] = {False: [], True: []}
    kv_time = {c: time_kv_calls(engines[c]) for c in (False, True)}
    for _ in range(args.rounds):
        prompts = [random_tokens(rng, s + u, vocab) for _ in range(n)]  # fresh tokens: nothing to hit
        for c in (False, True):
            t0 = sum(kv_time[c].values())
            unique_runs[c].append(run_batch(engines[c], prompts, o))
            unique_runs[c][-1]["kv_calls_s"] = sum(kv_time[c].values()) - t0
    unique = {c: min(runs, key=lambda r: r["wall_s"]) for c, runs in unique_runs.items()}
    kv_s = {c: statistics.fmean(r["kv_calls_s"] for r in runs) for c, runs in unique_runs.items()}
    kv_extra_frac = (kv_s[True] - kv_s[False]) / statistics.fmean(r["wall_s"] for r in unique_runs[False])

    convo_first = random_tokens(rng, s + u, vocab)
    convo = {c: run_conversation(engines[c], convo_first, args.turns, u, o, random.Random(1), vocab)
             for c in (False, True)}
    convo_same = [r["output"] for r in convo[False]] == [r["output"] for r in convo[True]]
    kv_bytes_per_token = engines[True].model_config.kv_bytes_per_token(torch.empty((), dtype=engines[True].dtype).element_size())
    del engines
    gc.collect()

    swap_rows = None
    if args.swap:
        swap_prompts = [random_tokens(rng, args.swap_prompt_len, vocab) for _ in range(args.swap_requests)]
        swap_rows = {}
        for mode in ("recompute", "swap"):
            engine = make_engine(args, kv_cache_memory=args.swap_kv_tokens * kv_bytes_per_token, preemption_mode=mode,
                                 swap_space=1.0 if mode == "swap" else 0.0, enable_prefix_caching=False)
            swap_rows[mode] = run_batch(engine, swap_prompts, args.swap_output_len)
            del engine
            gc.collect()
        swap_same = swap_rows["recompute"]["outputs"] == swap_rows["swap"]["outputs"]

    # ---- report ---------------------------------------------------------------------------
    print(f"\nmodel {args.model}, dtype {args.dtype}, threads {torch.get_num_threads()}, cores {os.cpu_count()}; "
          f"{n} requests x ({s} shared + {u} unique) in, {o} out, all submitted at once")
    print(f"{'workload':28s} {'caching':>7s} {'wall s':>8s} {'TTFT mean':>9s} {'TTFT p50':>9s} {'hit rate':>8s} {'vs off':>7s}")
    for name, runs in ((f"shared {s}-token prefix", shared), (f"no shared prefix (best of {args.rounds})", unique)):
        for c in (False, True):
            r = runs[c]
            print(f"{name:28s} {'on' if c else 'off':>7s} {r['wall_s']:8.2f} {r['ttft_mean_s']:9.3f} "
                  f"{r['ttft_p50_s']:9.3f} {100 * r['hit_rate']:7.1f}% {r['wall_s'] / runs[False]['wall_s']:7.3f}")
    print(f"no shared prefix: time inside KVCacheManager calls per run {1e3 * kv_s[False]:.1f} ms off, "
          f"{1e3 * kv_s[True]:.1f} ms on: "
          f"the bookkeeping adds {100 * kv_extra_frac:.2f}% to the uncached wall time")
    print(f"greedy outputs identical with caching off and on: shared {same_outputs}, conversation {convo_same}")
    print(f"\n{args.turns}-turn conversation (turn k+1 = turn k prompt + output + {u} new tokens)")
    print(f"{'turn':>4s} {'prompt':>7s} {'hit rate':>8s} {'TTFT off':>9s} {'TTFT on':>9s}")
    for off_row, on_row in zip(convo[False], convo[True], strict=True):
        print(f"{on_row['turn']:4d} {on_row['prompt_tokens']:7d} {100 * on_row['hit_rate']:7.1f}% "
              f"{off_row['ttft_s']:9.3f} {on_row['ttft_s']:9.3f}")
    if swap_rows:
        print(f"\npreemption: {args.swap_requests} requests x {args.swap_prompt_len} in x {args.swap_output_len} out, "
              f"device KV pool {args.swap_kv_tokens} tokens, prefix caching off")
        print(f"{'mode':>10s} {'wall s':>8s} {'preemptions':>11s} {'blocks out':>10s} {'blocks in':>9s}")
        for mode, r in swap_rows.items():
            print(f"{mode:>10s} {r['wall_s']:8.2f} {r['preemptions']:11d} {r['swapped_out_blocks']:10d} "
                  f"{r['swapped_in_blocks']:9d}")
        print(f"greedy outputs identical: {swap_same}")

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args),
        "shared": {("on" if c else "off"): strip(r) for c, r in shared.items()},
        "shared_cached_over_uncached_wall": shared[True]["wall_s"] / shared[False]["wall_s"],
        "unique": {("on" if c else "off"): [strip(r) for r in runs] for c, runs in unique_runs.items()},
        "unique_on_over_off_wall": unique[True]["wall_s"] / unique[False]["wall_s"],
        "unique_kv_calls_s": {"off": kv_s[False], "on": kv_s[True]},
        "unique_bookkeeping_over_wall": kv_extra_frac,
        "conversation": {("on" if c else "off"): [{k: v for k, v in r.items() if k != "output"} for r in rows]
                         for c, rows in convo.items()},
        "outputs_identical": {"shared": same_outputs, "conversation": convo_same},
        "swap": {m: strip(r) for m, r in swap_rows.items()} if swap_rows else None,
    }, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
