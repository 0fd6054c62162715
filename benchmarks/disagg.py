"""Prefill/decode disaggregation on this machine, then a simulated larger cluster.

1. Live (Ray actors, one CPU and one torch thread per worker): `--num-streams` streams decode
   while `--long-prompts` prompts of `--long-len` tokens arrive every `--long-interval` s.
   Colocated (one worker, chunked prefill) versus 1 prefill + 1 decode worker. Prints ITL p50/p99
   of the streams while the long prompts are in the system, TTFT p50/p99 of the long prompts,
   and the KV transfer times (export on the prefill worker, import on the decode worker, and the
   whole handoff as the router sees it).
2. Calibration: engine step times (decode batches, prefill chunks at growing context) fitted to
   the simulator's step-cost model, and the KV transfer cost per token through shared memory.
3. Simulation (tessera.disagg.sim) of an 8-worker cluster: the highest request rate at which 90%
   of requests meet a TTFT and an ITL objective (goodput capacity), colocated versus P:D splits,
   for several prompt/output mixes.

    /tmp/tools/quiet .venv/bin/python benchmarks/disagg.py [--out benchmarks/results/disagg.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from tessera import SamplingParams
from tessera.config import DEFAULT_MODEL, EngineConfig


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# ---- 1. live runs ----------------------------------------------------------------------------

async def run_workload(router, args, rng: random.Random) -> dict:
    vocab = router.model_config.vocab_size
    greedy = dict(temperature=0.0, ignore_eos=True)
    stream_times: dict[str, list[float]] = {}
    first_token: dict[str, float] = {}
    submitted: dict[str, float] = {}

    async def consume(rid: str, prompt: list[int], params: SamplingParams) -> None:
        submitted[rid] = time.monotonic()
        times = stream_times.setdefault(rid, [])
        async for out in router.generate(prompt, params, rid):
            now = time.monotonic()
            n = len(out.outputs[0].delta_token_ids)
            times.extend([now] * n)
            if rid not in first_token and n:
                first_token[rid] = now

    streams = [asyncio.ensure_future(consume(
        f"s{i}", [rng.randrange(vocab) for _ in range(args.stream_prompt)],
        SamplingParams(max_tokens=args.stream_tokens, **greedy))) for i in range(args.num_streams)]
    while len(first_token) < args.num_streams:  # every stream decoding before the long prompts come
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    window_start = time.monotonic()
    longs = []
    for j in range(args.long_prompts):
        longs.append(asyncio.ensure_future(consume(
            f"L{j}", [rng.randrange(vocab) for _ in range(args.long_len)],
            SamplingParams(max_tokens=args.long_tokens, **greedy))))
        if j + 1 < args.long_prompts:
            await asyncio.sleep(args.long_interval)
    await asyncio.gather(*longs)
    window_end = time.monotonic()
    router.abort([f"s{i}" for i in range(args.num_streams)])
    await asyncio.gather(*streams, return_exceptions=True)
    gaps = []
    for i in range(args.num_streams):
        t = [x for x in stream_times[f"s{i}"] if window_start <= x <= window_end]
        gaps += [b - a for a, b in zip(t, t[1:], strict=False)]
    stream_tokens = sum(len([x for x in stream_times[f"s{i}"] if window_start <= x <= window_end])
                        for i in range(args.num_streams))
    ttft_long = [first_token[f"L{j}"] - submitted[f"L{j}"] for j in range(args.long_prompts)]
    ttft_streams = [first_token[f"s{i}"] - submitted[f"s{i}"] for i in range(args.num_streams)]
    transfers = list(router.transfers)
    return {
        "window_s": window_end - window_start,
        "itl_p50_ms": 1e3 * pct(gaps, 0.5), "itl_p99_ms": 1e3 * pct(gaps, 0.99), "itl_max_ms": 1e3 * max(gaps),
        "stream_tokens_per_s": stream_tokens / (window_end - window_start),
        "ttft_long_p50_ms": 1e3 * pct(ttft_long, 0.5), "ttft_long_p99_ms": 1e3 * pct(ttft_long, 0.99),
        "ttft_stream_p50_ms": 1e3 * pct(ttft_streams, 0.5), "ttft_stream_p99_ms": 1e3 * pct(ttft_streams, 0.99),
        "transfers": [vars(t) for t in transfers],
    }


def live(args, config: EngineConfig, mode: str) -> dict:
    from tessera.disagg.cluster import ClusterConfig, create_router

    cluster = (ClusterConfig(prefill_workers=1, decode_workers=1, kv_transport=args.transport)
               if mode == "disagg" else ClusterConfig(data_parallel=1, kv_transport=args.transport))
    router = create_router(config, cluster)
    try:
        async def main():
            await router.start()
            return await run_workload(router, args, random.Random(0))

        return asyncio.run(main())
    finally:
        router.shutdown()
        time.sleep(1.0)  # let Ray reclaim the actors' CPUs


# ---- 2. calibration --------------------------------------------------------------------------

def calibrate(config: EngineConfig, args) -> dict:
    """Step times of one engine (one thread) fitted to StepCost, and the shm transfer cost."""
    from tessera.disagg.transport import SharedMemoryTransport
    from tessera.engine.engine import LLMEngine
    from tessera.engine.handoff import kv_nbytes, read_kv, write_kv

    torch.set_num_threads(1)
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    rng = random.Random(1)
    rows, times = [], []  # (1, prefill tokens, decodes, context work) -> seconds

    # decode batches
    for batch in (1, 8, 16, 32):
        for i in range(batch):
            engine.add_request(f"d{batch}-{i}", [rng.randrange(vocab) for _ in range(32)],
                               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()  # prefill + warm-up, not timed
            if all(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running) and not engine.scheduler.waiting:
                break
        for _ in range(6):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            rows.append((1.0, 0, batch, 0.0))
        engine.abort_request([f"d{batch}-{i}" for i in range(batch)])
    # prefill chunks of a long prompt at growing context (budget-sized chunks)
    budget = config.max_num_batched_tokens
    for rep in range(2):
        engine.add_request(f"p{rep}", [rng.randrange(vocab) for _ in range(args.long_len)],
                           SamplingParams(max_tokens=1, temperature=0.0))
        done = 0
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            n = min(budget, args.long_len - done)
            rows.append((1.0, n, 0, n * (done + n / 2) / 1e3))
            times.append(dt)
            done += n
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).clamp(min=0).tolist()
    # transfer: export (rows -> shm) + import (map, copy into the pool) of a long prompt's K/V
    transport = SharedMemoryTransport()
    caches = engine.runner.kv_caches
    transfer = []
    for n in (256, args.long_len):
        table = list(range(1, 1 + -(-n // engine.kv.block_size)))
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            kv = read_kv(caches, table, engine.kv.block_size, n, out=transport.alloc((kv_nbytes(caches, n),), torch.uint8))
            back = transport.receive(transport.ship(kv))
            write_kv(caches, table, engine.kv.block_size, back, n, 0)
            best = min(best, time.perf_counter() - t0)
        transfer.append((n, best))
    (n1, t1), (n2, t2) = transfer
    per_token = max(0.0, (t2 - t1) / (n2 - n1))
    return {"step_cost": {"base_s": coef[0], "per_prefill_token_s": coef[1], "per_decode_s": coef[2],
                          "per_context_token_s": coef[3]},
            "transfer": {"base_s": max(0.0, t1 - per_token * n1), "per_token_s": per_token},
            "kv_bytes_per_token": engine.model_config.kv_bytes_per_token(caches[0][0].element_size()),
            "num_step_samples": len(times)}


# ---- 3. simulation ---------------------------------------------------------------------------

def simulate_cluster(cal: dict, args) -> list[dict]:
    from tessera.disagg.sim import StepCost, TransferCost, max_goodput_rate

    cost = StepCost(**cal["step_cost"])
    transfer = TransferCost(**cal["transfer"])
    workers = args.sim_workers
    # Colocated gets its best prefill chunk (a smaller chunk stalls decodes less, prefills slower).
    splits = [(f"colocated/{b}", dict(colocated_workers=workers, budget=b)) for b in (128, 512)]
    for p in (1, 2, workers // 2):
        if 0 < p < workers and ("p", p) not in [("p", s[1].get("prefill_workers")) for s in splits]:
            splits.append((f"{p}P+{workers - p}D", dict(prefill_workers=p, decode_workers=workers - p)))
    rows = []
    decode16 = cost.step_s(0, 16)
    for prompt, output in ((2000, 200), (2000, 32), (256, 256), (64, 512)):
        # Objectives scale with the work: TTFT up to 2x the prompt's own prefill time (+1 s),
        # ITL up to 3x a 16-stream decode step.
        single_prefill = sum(cost.step_s(min(512, prompt - d), 0, min(512, prompt - d) * (d + min(512, prompt - d) / 2) / 1e3)
                             for d in range(0, prompt, 512))
        slo_ttft, slo_itl = 2 * single_prefill + 1.0, 3 * decode16
        row = {"prompt": prompt, "output": output, "slo_ttft_s": slo_ttft, "slo_itl_ms": 1e3 * slo_itl}
        for name, cluster in splits:
            row[name] = max_goodput_rate(cost, transfer, prompt, output, slo_ttft, slo_itl,
                                         duration_s=args.sim_duration, **cluster)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-streams", type=int, default=16)
    p.add_argument("--stream-prompt", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=1000, help="streams are aborted once the long prompts are done")
    p.add_argument("--long-prompts", type=int, default=3)
    p.add_argument("--long-len", type=int, default=2000)
    p.add_argument("--long-interval", type=float, default=4.0)
    p.add_argument("--long-tokens", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--transport", default="shm", choices=["shm", "ray"])
    p.add_argument("--sim-workers", type=int, default=8)
    p.add_argument("--sim-duration", type=float, default=120.0)
    p.add_argument("--skip-live", action="store_true")
    p.add_argument("--reuse", default=None,
                   help="take the live results and the calibration from this JSON (an earlier --out) and only simulate")
    p.add_argument("--out", default="benchmarks/results/disagg.json")
    args = p.parse_args(argv)

    config = EngineConfig(model=args.model, dtype="float32", max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=8192, num_threads=1, kv_cache_memory=2 << 30)
    result: dict = {"args": vars(args)}
    reused = json.loads(Path(args.reuse).read_text()) if args.reuse else None
    if reused:
        result.update({k: reused[k] for k in ("colocated", "disagg", "itl_p99_ratio", "calibration") if k in reused})
    if not args.skip_live and not reused:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        for mode in ("colocated", "disagg"):
            print(f"live run: {mode} ...", file=sys.stderr, flush=True)
            result[mode] = live(args, config, mode)
        ray.shutdown()
        print(f"\nLive: {args.num_streams} streams decoding while {args.long_prompts} prompts of {args.long_len} "
              f"tokens arrive every {args.long_interval:g} s ({args.model}, fp32, 1 core per worker)")
        print(f"{'':12} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'stream tok/s':>12}")
        for mode in ("colocated", "disagg"):
            r = result[mode]
            print(f"{mode:12} {r['itl_p50_ms']:8.0f}ms {r['itl_p99_ms']:8.0f}ms {r['itl_max_ms']:8.0f}ms "
                  f"{r['ttft_long_p50_ms']:8.0f}ms {r['ttft_long_p99_ms']:8.0f}ms {r['stream_tokens_per_s']:12.1f}")
        tr = [t for t in result["disagg"]["transfers"] if t["num_tokens"] >= args.long_len // 2]
        if tr:
            print(f"KV transfer of a {args.long_len}-token prompt ({args.transport}): export "
                  f"{1e3 * statistics.median(t['export_s'] for t in tr):.1f} ms, import "
                  f"{1e3 * statistics.median(t['import_s'] for t in tr):.1f} ms, handoff (router) "
                  f"{1e3 * statistics.median(t['handoff_s'] for t in tr):.1f} ms (medians of {len(tr)})")
        ratio = result["disagg"]["itl_p99_ms"] / result["colocated"]["itl_p99_ms"]
        print(f"ITL p99 disaggregated / colocated: {ratio:.2f} (target <= 0.5)")
        result["itl_p99_ratio"] = ratio
    if reused:
        cal = reused["calibration"]
    else:
        print("\ncalibrating step and transfer costs ...", file=sys.stderr, flush=True)
        cal = calibrate(config, args)
    result["calibration"] = cal
    c, t = cal["step_cost"], cal["transfer"]
    print(f"\nStep cost: {1e3 * c['base_s']:.1f} ms + {1e3 * c['per_prefill_token_s']:.3f} ms/prompt token + "
          f"{1e3 * c['per_decode_s']:.2f} ms/decode + {1e3 * c['per_context_token_s']:.4f} ms per 1e3 query x context; "
          f"transfer {1e3 * t['base_s']:.1f} ms + {1e6 * t['per_token_s']:.1f} us/token "
          f"({cal['kv_bytes_per_token'] / 1024:.0f} KiB/token)")
    rows = simulate_cluster(cal, args)
    result["simulation"] = rows
    names = [k for k in rows[0] if k not in ("prompt", "output", "slo_ttft_s", "slo_itl_ms")]
    print(f"\nSimulated {args.sim_workers}-worker cluster: goodput capacity (req/s with >= 90% of requests within "
          f"both SLOs)")
    print(f"{'prompt':>6} {'output':>6} {'TTFT SLO':>9} {'ITL SLO':>8} " + " ".join(f"{n:>10}" for n in names))
    for r in rows:
        print(f"{r['prompt']:6d} {r['output']:6d} {r['slo_ttft_s']:8.1f}s {r['slo_itl_ms']:6.0f}ms "
              + " ".join(f"{r[n]:10.3f}" for n in names))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
