"""`tessera bench load`: a bounded load generator that checks every answer it gets.

Streaming requests go to /v1/completions and /v1/chat/completions of a server on this machine,
from `--clients` concurrent clients (closed loop: each sends its next request when the last one
ended) or at a Poisson `--rate` (open loop, at most `--max-in-flight` at once). A fraction of the
requests (`--disconnect-fraction`) hang up at a random point: right after the headers or after a
random number of chunks. Every other answer is checked: status 200, an SSE body of JSON chunks that
parse as the API's own response models, one id, exactly one finish_reason (on the last choice
chunk), the usage chunk's token count, `data: [DONE]` last. Prompts come from a small fixed set and
decoding is greedy, so every answer to the same prompt must have the same text, however the
requests were batched. A 503 is counted as a rejection (with its latency), not an error.

Bounded on purpose: `--duration` seconds and `--max-requests` requests at most, loopback only.
Prints requests served, rejections, errors and latency percentiles; returns the summary.

    tessera bench load --clients 64 --duration 15 --disconnect-fraction 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import ValidationError

from tessera.bench.serve import check_loopback, percentiles
from tessera.server.protocol import ChatCompletionChunk, CompletionResponse

MAX_CLIENTS = 4096
MAX_DURATION_S = 3600.0
MAX_REQUESTS = 1_000_000
_WORDS = ("paged", "attention", "kv", "cache", "block", "token", "stream", "batch", "prefill", "decode", "engine",
          "scheduler", "tensor", "weights", "latency")


@dataclass
class Outcome:
    kind: str  # ok | disconnected | rejected | error | malformed
    endpoint: str = ""
    prompt_index: int = -1
    status: int = 0
    latency: float = 0.0  # seconds: to [DONE] (ok), to the 503 (rejected), to the hang-up
    ttft: float | None = None
    text: str = ""
    detail: str = ""


@dataclass
class LoadStats:
    outcomes: list[Outcome] = field(default_factory=list)
    sent: int = 0


def make_prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"prompt {i}: " + " ".join(rng.choice(_WORDS) for _ in range(words)) for i in range(count)]


def request_body(args: argparse.Namespace, endpoint: str, prompt: str) -> dict:
    body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.timeout is not None:
        body["timeout"] = args.timeout
    return body


class MalformedStream(Exception):
    pass


def check_stream(endpoint: str, lines: list[str], max_tokens: int) -> str:
    """The text of a complete, well-formed stream; raises MalformedStream naming what is wrong."""
    events = [x for x in lines if x]
    if not events or events[-1] != "data: [DONE]":
        raise MalformedStream(f"the stream does not end with 'data: [DONE]' (last: {events[-1:]!r})")
    if any(not x.startswith("data: ") for x in events):
        raise MalformedStream(f"a line is not an SSE data line: {next(x for x in events if not x.startswith('data: '))!r}")
    model = ChatCompletionChunk if endpoint == "chat" else CompletionResponse
    chunks = []
    for x in events[:-1]:
        if x == "data: [DONE]":
            raise MalformedStream("'data: [DONE]' before the end")
        try:
            data = json.loads(x[6:])
        except json.JSONDecodeError as exc:
            raise MalformedStream(f"a chunk is not JSON: {exc}") from None
        if "error" in data:
            raise MalformedStream(f"in-band error: {data['error']}")
        try:
            chunks.append(model.model_validate(data))
        except ValidationError as exc:
            raise MalformedStream(f"a chunk does not parse as {model.__name__}: {exc.errors()[:1]}") from None
    if len({c.id for c in chunks}) != 1:
        raise MalformedStream("the chunks carry different ids")
    with_choices = [c for c in chunks if c.choices]
    usage = [c for c in chunks if not c.choices]
    if len(usage) != 1 or chunks[-1] is not usage[0] or usage[0].usage is None:
        raise MalformedStream("expected exactly one usage chunk, last")
    if any(len(c.choices) != 1 or c.choices[0].index != 0 for c in with_choices):
        raise MalformedStream("a chunk has choices other than index 0")
    finishes = [i for i, c in enumerate(with_choices) if c.choices[0].finish_reason is not None]
    if finishes != [len(with_choices) - 1]:
        raise MalformedStream(f"finish_reason set on chunks {finishes} of {len(with_choices)}")
    reason = with_choices[-1].choices[0].finish_reason
    if reason != "length":
        raise MalformedStream(f"finish_reason {reason!r}, expected 'length' (ignore_eos, max_tokens)")
    if usage[0].usage.completion_tokens != max_tokens or usage[0].usage.prompt_tokens < 1:
        raise MalformedStream(f"usage {usage[0].usage} does not match max_tokens {max_tokens}")
    if endpoint == "chat":
        if with_choices[0].choices[0].delta.role != "assistant":
            raise MalformedStream("the first chat chunk does not carry the assistant role")
        return "".join(c.choices[0].delta.content or "" for c in with_choices)
    return "".join(c.choices[0].text for c in with_choices)


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random,
                      prompts: list[str]) -> Outcome:
    endpoint = args.endpoint if args.endpoint != "mixed" else rng.choice(("completions", "chat"))
    index = rng.randrange(len(prompts))
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    # A leaver hangs up after this many data lines (0: as soon as the headers arrive).
    leave_after = rng.randint(0, args.max_tokens) if rng.random() < args.disconnect_fraction else None
    out = Outcome(kind="error", endpoint=endpoint, prompt_index=index)
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=request_body(args, endpoint, prompts[index])) as r:
            out.status = r.status_code
            if r.status_code == 503:
                await r.aread()
                out.kind, out.latency = "rejected", time.perf_counter() - start
                out.detail = r.headers.get("retry-after", "")
                return out
            if r.status_code != 200:
                out.detail = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return out
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                out.kind, out.detail = "malformed", f"content-type {r.headers.get('content-type')!r}"
                return out
            lines: list[str] = []
            data_lines = 0
            if leave_after == 0:
                out.kind, out.latency = "disconnected", time.perf_counter() - start
                return out
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    data_lines += 1
                    if out.ttft is None:
                        out.ttft = time.perf_counter() - start
                    if leave_after is not None and data_lines >= leave_after:
                        out.kind, out.latency = "disconnected", time.perf_counter() - start
                        return out
        out.latency = time.perf_counter() - start
        try:  # a would-be leaver whose stream ended first is checked like everyone else
            out.text = check_stream(endpoint, lines, args.max_tokens)
            out.kind = "ok"
        except MalformedStream as exc:
            out.kind, out.detail = "malformed", str(exc)
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        out.detail = f"{exc!r} {'mid-stream' if out.status else 'before the response'}"
    return out


async def run_load(args: argparse.Namespace) -> dict:
    prompts = make_prompts(args.num_distinct_prompts, args.prompt_words, args.seed)
    concurrency = args.max_in_flight if args.rate else args.clients
    # Idle connections expire here before the server's keep-alive timeout (uvicorn: 5 s) can close
    # them under a request that is just being sent on one.
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8,
                          keepalive_expiry=2.0)
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    stats = LoadStats()
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=timeout, headers=headers) as client:
        if args.model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            args.model = r.json()["data"][0]["id"]
        start = time.perf_counter()
        deadline = start + args.duration

        def budget_left() -> bool:
            return time.perf_counter() < deadline and stats.sent < args.max_requests

        async def closed_loop_client(i: int) -> None:
            rng = random.Random(args.seed * 100_003 + i)
            while budget_left():
                stats.sent += 1
                out = await one_request(client, args, rng, prompts)
                stats.outcomes.append(out)
                if out.kind == "rejected":
                    await asyncio.sleep(args.retry_pause)

        async def open_loop() -> None:
            rng = random.Random(args.seed)
            in_flight: set[asyncio.Task] = set()
            sem = asyncio.Semaphore(args.max_in_flight)

            async def fire(req_rng: random.Random) -> None:
                try:
                    stats.outcomes.append(await one_request(client, args, req_rng, prompts))
                finally:
                    sem.release()

            next_at = time.perf_counter()
            while budget_left():
                await sem.acquire()  # the client's own bound: at most max_in_flight open requests
                stats.sent += 1
                task = asyncio.ensure_future(fire(random.Random(rng.random())))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                # Arrival times on the clock, not sleeps after each send: a busy event loop that
                # wakes late catches up, so the offered rate holds.
                next_at += rng.expovariate(args.rate)
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            if in_flight:
                await asyncio.wait(in_flight)

        work = open_loop() if args.rate else asyncio.gather(*(closed_loop_client(i) for i in range(args.clients)))
        try:
            # Requests started before the deadline may finish after it, within the read timeout.
            await asyncio.wait_for(work, timeout=args.duration + args.request_timeout + 10)
        except asyncio.TimeoutError:
            pass
        duration = time.perf_counter() - start
    if getattr(args, "plot", None):
        from tessera.bench.plots import plot_latency_cdfs

        ok = [o for o in stats.outcomes if o.kind == "ok"]
        plot_latency_cdfs({"first chunk": [o.ttft for o in ok if o.ttft is not None],
                           "end to end": [o.latency for o in ok]}, args.plot, title=f"tessera bench load: {len(ok)} served")
    return summarize(args, stats, duration)


def summarize(args: argparse.Namespace, stats: LoadStats, duration: float) -> dict:
    outs = stats.outcomes
    by_kind = Counter(o.kind for o in outs)
    ok = [o for o in outs if o.kind == "ok"]
    texts: dict[tuple[str, int], set[str]] = defaultdict(set)
    for o in ok:
        texts[(o.endpoint, o.prompt_index)].add(o.text)
    errors = Counter(o.detail for o in outs if o.kind in ("error", "malformed"))
    return {
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "sent": stats.sent,
        "finished": len(outs),
        "completed": by_kind["ok"],
        "disconnected": by_kind["disconnected"],
        "rejected": by_kind["rejected"],
        "errors": by_kind["error"],
        "malformed": by_kind["malformed"],
        "error_messages": dict(errors.most_common(10)),
        # Greedy answers to the same prompt that differ: cross-talk between requests.
        "inconsistent_prompts": sum(len(v) > 1 for v in texts.values()),
        "duration_s": duration,
        "completed_per_s": len(ok) / duration if duration else 0.0,
        "latency_ms": percentiles([o.latency for o in ok]),
        "ttft_ms": percentiles([o.ttft for o in ok if o.ttft is not None]),
        "rejection_latency_ms": percentiles([o.latency for o in outs if o.kind == "rejected"]),
    }


def print_report(s: dict) -> None:
    cfg = s["config"]
    mode = f"Poisson {cfg['rate']:g}/s (at most {cfg['max_in_flight']} open)" if cfg["rate"] else \
        f"{cfg['clients']} closed-loop clients"
    print(f"\nLoad: {mode}, {cfg['endpoint']} streams of {cfg['max_tokens']} tokens, "
          f"{cfg['disconnect_fraction']:.0%} hang up")
    print(f"  duration           {s['duration_s']:10.1f} s")
    print(f"  requests sent      {s['sent']:10d}")
    print(f"  served (complete)  {s['completed']:10d}   {s['completed_per_s']:.1f}/s")
    print(f"  hung up on purpose {s['disconnected']:10d}")
    print(f"  rejected (503)     {s['rejected']:10d}")
    print(f"  errors             {s['errors']:10d}")
    print(f"  malformed streams  {s['malformed']:10d}")
    print(f"  inconsistent texts {s['inconsistent_prompts']:10d}   (prompts whose greedy answers differ)")
    print(f"\n  {'ms':<18}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, label in (("latency_ms", "e2e (served)"), ("ttft_ms", "first chunk"),
                       ("rejection_latency_ms", "to the 503")):
        row = s[key]
        cells = "".join(f"{row[p]:10.1f}" if row[p] is not None else f"{'-':>10}" for p in ("mean", "p50", "p90", "p99"))
        print(f"  {label:<18}{cells}")
    for msg, count in s["error_messages"].items():
        print(f"  x{count}: {msg}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a server on this machine")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--clients", type=int, default=64, help="concurrent closed-loop clients (without --rate)")
    p.add_argument("--rate", "--request-rate", dest="rate", type=float, default=None,
                   help="open loop: Poisson arrivals per second instead")
    p.add_argument("--max-in-flight", type=int, default=1024, help="open loop: most requests open at once")
    p.add_argument("--duration", type=float, default=15.0, help="seconds to send requests for")
    p.add_argument("--max-requests", "--num-prompts", dest="max_requests", type=int, default=100_000,
                   help="stop after sending this many")
    p.add_argument("--endpoint", choices=["completions", "chat", "mixed"], default="mixed",
                   help="which API the clients call (mixed: both, alternately)")
    p.add_argument("--max-tokens", "--output-len", dest="max_tokens", type=int, default=16,
                   help="tokens per answer (ignore_eos)")
    p.add_argument("--prompt-words", type=int, default=8, help="words per generated prompt")
    p.add_argument("--num-distinct-prompts", type=int, default=8,
                   help="distinct prompts the clients draw from (repeats must get the same greedy text)")
    p.add_argument("--disconnect-fraction", type=float, default=0.2, help="share of requests that hang up early")
    p.add_argument("--timeout", type=float, default=None, help="the `timeout` field sent with each request")
    p.add_argument("--request-timeout", type=float, default=120.0, help="client-side read timeout, seconds")
    p.add_argument("--retry-pause", type=float, default=0.05, help="closed loop: pause after a 503, seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, arrivals and disconnects")
    p.add_argument("--out", "--output-json", dest="out", default="", help="write the JSON summary here")
    p.add_argument("--plot", default=None, metavar="PNG", help="latency CDFs here (needs matplotlib: the plots extra)")


def validate(args: argparse.Namespace) -> None:
    check_loopback(args.base_url)
    if not 1 <= args.clients <= MAX_CLIENTS:
        raise SystemExit(f"--clients must be in [1, {MAX_CLIENTS}]")
    if not 0 < args.duration <= MAX_DURATION_S:
        raise SystemExit(f"--duration must be in (0, {MAX_DURATION_S:g}] seconds")
    if not 1 <= args.max_requests <= MAX_REQUESTS:
        raise SystemExit(f"--max-requests must be in [1, {MAX_REQUESTS}]")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise SystemExit("--rate must be a finite number > 0")
    if not 1 <= args.max_in_flight <= MAX_CLIENTS:
        raise SystemExit(f"--max-in-flight must be in [1, {MAX_CLIENTS}]")
    if not 0 <= args.disconnect_fraction <= 1:
        raise SystemExit("--disconnect-fraction must be in [0, 1]")
    if args.max_tokens < 1 or args.num_distinct_prompts < 1:
        raise SystemExit("--max-tokens and --num-distinct-prompts must be >= 1")


def run(args: argparse.Namespace) -> dict:
    validate(args)
    summary = asyncio.run(run_load(args))
    print_report(summary)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2, default=str))
    return summary


def exit_code(summary: dict) -> int:
    """1 when any answer was wrong (an error, a malformed stream, differing greedy texts), else 0."""
    return int(bool(summary["errors"] or summary["malformed"] or summary["inconsistent_prompts"]))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="tessera bench load", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
