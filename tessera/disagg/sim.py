"""A discrete-event simulation of a serving cluster, colocated versus disaggregated, driven by a
measured step-cost model and a measured KV transfer cost. It answers: for this model on this
hardware, at which prompt/output mix and load does splitting prefill from decode raise goodput
(requests per second that meet both a TTFT and an ITL objective), and where does it not?

Step cost: t = base + per_prefill_token * prefill tokens + per_decode * decodes
               + per_context_token * (context tokens the prefill chunks attend to)
(fitted by benchmarks/disagg.py from timed engine steps). Workers run continuous batching:
- colocated: every step serves all running decodes plus a prefill chunk from the queue
  (chunked prefill, FCFS), within a token budget; a long prompt's chunks slow every decode.
- prefill worker: prefill chunks only (a larger budget: nobody's decode waits on it); a finished
  prompt's K/V take transfer_s(tokens) to reach the least-loaded decode worker.
- decode worker: decodes only; an arriving handoff waits until the batch has room.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepCost:
    base_s: float
    per_prefill_token_s: float
    per_decode_s: float
    per_context_token_s: float = 0.0  # attention of a prefill chunk over its context, per query x context / 1e3

    def step_s(self, prefill_tokens: int, decodes: int, context_work: float = 0.0) -> float:
        return (self.base_s + self.per_prefill_token_s * prefill_tokens + self.per_decode_s * decodes
                + self.per_context_token_s * context_work)


@dataclass(frozen=True)
class TransferCost:
    base_s: float
    per_token_s: float

    def transfer_s(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens


@dataclass
class SimRequest:
    arrival: float
    prompt: int
    output: int
    done_prompt: int = 0
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def max_itl(self) -> float:
        """The request's largest gap between tokens. Not a percentile: a disaggregated request
        that waits for room on a decode worker after its first token stalls once, and a p99
        over hundreds of gaps would forgive that stall however long it was."""
        return max((b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)), default=0.0)


@dataclass
class _Worker:
    role: str  # colocated | prefill | decode
    queue: list[SimRequest] = field(default_factory=list)
    running: list[SimRequest] = field(default_factory=list)
    busy_until: float = 0.0
    stepping: bool = False


def simulate(workload: list[SimRequest], cost: StepCost, transfer: TransferCost, *, prefill_workers: int = 0,
             decode_workers: int = 0, colocated_workers: int = 0, budget: int = 512, prefill_budget: int = 2048,
             max_num_seqs: int = 64) -> list[SimRequest]:
    """Run the workload (copied) through the cluster; return the finished requests."""
    reqs = [SimRequest(r.arrival, r.prompt, r.output) for r in workload]
    workers = ([_Worker("colocated") for _ in range(colocated_workers)] + [_Worker("prefill") for _ in range(
        prefill_workers)] + [_Worker("decode") for _ in range(decode_workers)])
    entry = [w for w in workers if w.role in ("colocated", "prefill")]
    decoders = [w for w in workers if w.role == "decode"]
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, obj) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, obj))
        seq += 1

    for r in reqs:
        push(r.arrival, "arrive", r)

    def load(w: _Worker) -> float:
        return sum(r.prompt - r.done_prompt for r in w.queue) / 512 + len(w.running)

    def kick(w: _Worker, now: float) -> None:
        if w.stepping or not (w.queue or w.running):
            return
        w.stepping = True
        decodes = list(w.running) if w.role != "prefill" else []
        left = (prefill_budget if w.role == "prefill" else budget) - len(decodes)
        chunks: list[tuple[SimRequest, int]] = []
        if w.role != "decode":
            for r in w.queue:
                if left <= 0 or len(decodes) + len(chunks) >= max_num_seqs:
                    break
                n = min(r.prompt - r.done_prompt, left)
                chunks.append((r, n))
                left -= n
            admitted = []
        else:
            admitted = w.queue[: max(0, max_num_seqs - len(w.running))]
            del w.queue[: len(admitted)]
            decodes += admitted
        work = sum(n * (r.done_prompt + n / 2) / 1e3 for r, n in chunks)
        dt = cost.step_s(sum(n for _, n in chunks), len(decodes), work)
        push(now + dt, "step", (w, decodes, chunks, admitted))

    while events:
        now, _, kind, obj = heapq.heappop(events)
        if kind == "arrive":
            w = min(entry, key=load)
            w.queue.append(obj)
            kick(w, now)
        elif kind == "handoff":
            w = min(decoders, key=lambda d: len(d.running) + len(d.queue))
            w.queue.append(obj)
            kick(w, now)
        else:
            w, decodes, chunks, admitted = obj
            w.stepping = False
            if w.role == "decode":
                w.running += admitted
            for r in decodes:
                r.token_times.append(now)
            w.running = [r for r in w.running if len(r.token_times) < r.output]
            for r, n in chunks:
                r.done_prompt += n
                if r.done_prompt == r.prompt:
                    w.queue.remove(r)
                    r.token_times.append(now)  # the last chunk samples the first token
                    if len(r.token_times) >= r.output:
                        continue
                    if w.role == "prefill":
                        push(now + transfer.transfer_s(r.prompt), "handoff", r)
                    else:
                        w.running.append(r)
            kick(w, now)
            for d in decoders if w.role == "prefill" else ():
                kick(d, now)
    return reqs


def poisson_workload(rate: float, duration_s: float, prompt: int, output: int, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    t, reqs = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            return reqs
        reqs.append(SimRequest(t, prompt, output))


def goodput(done: list[SimRequest], duration_s: float, slo_ttft_s: float, slo_itl_s: float) -> float:
    """Requests per second that met both objectives."""
    ok = sum(1 for r in done if len(r.token_times) >= r.output and r.ttft <= slo_ttft_s and r.max_itl <= slo_itl_s)
    return ok / duration_s


def max_goodput_rate(cost: StepCost, transfer: TransferCost, prompt: int, output: int, slo_ttft_s: float,
                     slo_itl_s: float, attain: float = 0.9, duration_s: float = 120.0, **cluster) -> float:
    """The highest arrival rate (req/s, bisected) at which >= `attain` of requests meet both SLOs."""

    def ok(rate: float) -> bool:
        wl = poisson_workload(rate, duration_s, prompt, output)
        if not wl:
            return True
        done = simulate(wl, cost, transfer, **cluster)
        return goodput(done, duration_s, slo_ttft_s, slo_itl_s) * duration_s >= attain * len(wl)

    lo, hi = 0.0, 0.25
    while ok(hi):  # the simulation's cost grows with the rate: stop at 20k requests
        lo, hi = hi, hi * 2
        if hi * duration_s > 20_000:
            return lo
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
