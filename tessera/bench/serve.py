"""Serving benchmark: load a running Tessera (or any OpenAI-compatible) server and measure latency.

Requests go to /v1/completions as streams, either at a Poisson rate (`--request-rate`) or with a
fixed number in flight (`--max-concurrency`), or both. Each prompt is exactly `--input-len`
tokens (sent as token ids, measured with the server's /tokenize) and each answer exactly
`--output-len` tokens (ignore_eos). Prints TTFT, TPOT, ITL and end-to-end latency (mean, p50,
p90, p99), request and token throughput, and goodput under the given SLOs; writes JSON.

Bounded on purpose: at most `--num-prompts` requests and `--max-duration` seconds, and only to a
loopback address.

    python benchmarks/serve.py --num-prompts 64 --request-rate 8 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import random
import string
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

MAX_PROMPTS = 10_000


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"--base-url {base_url}: this benchmark only targets a server on this machine (loopback)")


def random_text(rng: random.Random, num_words: int) -> str:
    words = ("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8))) for _ in range(num_words))
    return " ".join(words)


async def make_prompts(client: httpx.AsyncClient, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """`num_prompts` (token-id prompt, output length): exactly `input_len` and `output_len` tokens
    each, or a ShareGPT-shaped file's prompts and reply lengths (tokenized by the server)."""
    rng = random.Random(args.seed)

    async def exact(text: str) -> list[int]:
        ids: list[int] = []
        while len(ids) < args.input_len:
            r = await client.post("/tokenize", json={"model": args.model, "prompt": text, "add_special_tokens": False})
            r.raise_for_status()
            ids = r.json()["tokens"]
            text += " " + random_text(rng, args.input_len)
        return ids[: args.input_len]

    if args.dataset == "sharegpt":
        return await sharegpt_prompts(client, args)
    if args.dataset == "fixed":
        ids = await exact(args.prompt or random_text(rng, args.input_len))
        return [(ids, args.output_len)] * args.num_prompts
    return [(await exact(random_text(rng, args.input_len)), args.output_len) for _ in range(args.num_prompts)]


async def sharegpt_prompts(client: httpx.AsyncClient, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    from tessera.bench.datasets import read_sharegpt

    if not args.dataset_path:
        raise SystemExit("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-shaped JSON list)")
    pairs = read_sharegpt(args.dataset_path)
    random.Random(args.seed).shuffle(pairs)
    out = []
    for prompt, reply in pairs[: args.num_prompts]:
        ids = []
        for text in (prompt, reply):
            r = await client.post("/tokenize", json={"model": args.model, "prompt": text, "add_special_tokens": False})
            r.raise_for_status()
            ids.append(r.json()["tokens"])
        out.append((ids[0], args.output_len if args.output_len_given else max(1, len(ids[1]))))
    return out


async def send_one(client: httpx.AsyncClient, args: argparse.Namespace, prompt: list[int],
                   output_len: int) -> RequestResult:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(prompt_len=len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                if data.get("choices") and data["choices"][0].get("text"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.ok = last is not None
        if not res.ok:
            res.error = "no text streamed"
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        res.error = repr(exc)
    return res


async def run_load(args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=max(args.max_concurrency or 0, 256), max_keepalive_connections=256)
    timeout = httpx.Timeout(args.max_duration, connect=10)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=timeout, headers=headers) as client:
        if args.model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            args.model = r.json()["data"][0]["id"]
        prompts = await make_prompts(client, args)
        rng = random.Random(args.seed + 1)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt: tuple[list[int], int]) -> RequestResult:
            if sem is None:
                return await send_one(client, args, *prompt)
            async with sem:
                return await send_one(client, args, *prompt)

        start = time.perf_counter()
        deadline = start + args.max_duration
        tasks = []
        for prompt in prompts:
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.ensure_future(limited(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        duration = time.perf_counter() - start
        results = [t.result() for t in done]
        results += [RequestResult(error="cut off by --max-duration") for _ in pending]
    if args.plot:
        from tessera.bench.plots import plot_latency_cdfs

        ok = [r for r in results if r.ok]
        plot_latency_cdfs({"TTFT": [r.ttft for r in ok], "TPOT": [t for r in ok if (t := r.tpot) is not None],
                           "inter-token": [x for r in ok for x in r.itl], "end to end": [r.e2e for r in ok]},
                          args.plot, title=f"tessera bench serve: {len(ok)} requests")
    return summarize(args, results, duration)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(values)

    def pct(p: float) -> float:
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return (s[lo] + (s[hi] - s[lo]) * (k - lo)) * 1000

    return {"mean": sum(s) / len(s) * 1000, "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)

    def meets_slo(r: RequestResult) -> bool:
        if args.slo_ttft_ms is not None and r.ttft * 1000 > args.slo_ttft_ms:
            return False
        return not (args.slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1000 > args.slo_tpot_ms)

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "config": {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
                   for k, v in vars(args).items() if k != "api_key"},
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "goodput": sum(map(meets_slo, ok)) / duration if duration else 0.0,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        "requests": [asdict(r) | {"tpot": r.tpot} for r in results] if args.save_requests else None,
    }


def print_report(summary: dict) -> None:
    cfg = summary["config"]
    rate = cfg["request_rate"] if cfg["request_rate"] == "inf" else f"{cfg['request_rate']:g}/s"
    print(f"\nServing benchmark: {summary['completed']}/{summary['num_requests']} requests ok, rate {rate}, "
          f"max concurrency {cfg['max_concurrency'] or '-'}, input {cfg['input_len']}, output {cfg['output_len']}")
    print(f"  duration             {summary['duration_s']:10.2f} s")
    print(f"  request throughput   {summary['request_throughput']:10.2f} req/s")
    print(f"  output throughput    {summary['output_token_throughput']:10.1f} tok/s")
    print(f"  total throughput     {summary['total_token_throughput']:10.1f} tok/s")
    slo = [f"TTFT <= {cfg['slo_ttft_ms']} ms" if cfg["slo_ttft_ms"] is not None else "",
           f"TPOT <= {cfg['slo_tpot_ms']} ms" if cfg["slo_tpot_ms"] is not None else ""]
    print(f"  goodput              {summary['goodput']:10.2f} req/s  ({', '.join(s for s in slo if s) or 'no SLO'})")
    print(f"\n  {'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft", "tpot", "itl", "e2e"):
        row = summary[f"{key}_ms"]
        cells = "".join(f"{row[p]:10.1f}" if row[p] is not None else f"{'-':>10}"
                        for p in ("mean", "p50", "p90", "p99"))
        print(f"  {key.upper():<6}{cells}")
    for err, count in summary["errors"].items():
        print(f"  failed x{count}: {err}")


def build_parser() -> argparse.ArgumentParser:
    from tessera.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="tessera bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a server on this machine")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (inf: send all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=None,
                   help="tokens per answer (ignore_eos; default 64, or each ShareGPT reply's length)")
    p.add_argument("--dataset-name", "--dataset", dest="dataset", choices=["random", "fixed", "sharegpt"],
                   default="random", help="random: a different random prompt each; fixed: one prompt for all "
                                          "(prefix cache hits); sharegpt: prompts from --dataset-path")
    p.add_argument("--dataset-path", default=None, help="a ShareGPT-shaped JSON file (tessera/bench/datasets.py)")
    p.add_argument("--prompt", default=None, help="the text of the fixed prompt (default: random words)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival times")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="count requests whose TTFT meets this SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="count requests whose TPOT meets this SLO")
    p.add_argument("--max-duration", type=float, default=600.0, help="stop after this many seconds")
    p.add_argument("--output-json", "--out", dest="out", default="serve_bench.json",
                   help="where to write the JSON results ('' for nowhere)")
    p.add_argument("--plot", default=None, metavar="PNG", help="latency CDFs here (needs matplotlib: the plots extra)")
    p.add_argument("--save-requests", action="store_true", help="include every request's timings in the JSON")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    args.output_len_given = args.output_len is not None
    if args.output_len is None:
        args.output_len = 64
    check_loopback(args.base_url)
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        raise SystemExit(f"--num-prompts must be in [1, {MAX_PROMPTS}]")
    if args.input_len < 1 or args.output_len < 1:
        raise SystemExit("--input-len and --output-len must be >= 1")
    if args.request_rate <= 0:
        raise SystemExit("--request-rate must be > 0 (inf: all at once)")
    summary = asyncio.run(run_load(args))
    print_report(summary)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2, default=str))
        print(f"\nwrote {args.out}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
