"""A small discrete-event model of the engine: the step cost model and a scheduler simulation.

The cost of one engine step is modelled as `base + per_decode * decodes + per_prefill_token *
prefill tokens + per_attention * (query, key) pairs`, four figures measured on the real model
(profile.measure_step_costs); the last makes long contexts cost what attention over them does. The
simulation replays a trace through the same policy as tessera.engine.scheduler (running
sequences first, one decode each, the newest takes a prefill chunk of what is left of the token
budget, then FCFS admission) and returns each request's TTFT and time per output token, the
running batch and KV use over time, and the time spent in prefill and in decode. The advisor
uses it for what cannot be replayed cheaply on the real model: the trace's concurrency, chunk
budgets against the SLOs, and whether splitting prefill and decode workers would pay.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

# Which percentile of a request's inter-token gaps the ITL objective bounds.
ITL_PERCENTILE = 99


@dataclass(frozen=True)
class StepCosts:
    base_s: float  # fixed cost of one step (scheduling, launch, sampling setup)
    per_decode_s: float  # each sequence that decodes one token
    per_prefill_token_s: float  # each prompt token computed in a prefill chunk
    source: str = "assumed"
    # Each (query token, cached key) pair attention reads: a decode at context c adds c, a chunk
    # of n tokens starting at position s adds n * (s + n / 2).
    per_attention_s: float = 0.0
    weight_bytes: int | None = None  # what the model's weights took in the measured engine
    # How much slower than modelled a step runs at a bad moment: the p90 of observed / modelled
    # step time where steps were observed (calibrate.fit_step_costs), 1 where they were not. A
    # request's p99 gap over a few dozen tokens is its slowest steps, so the ITL it sees is the
    # modelled step times this much slower.
    slowdown: float = 1.0

    def step_time(self, prefill_tokens: int, num_decodes: int, attention_pairs: float = 0.0) -> float:
        return (self.base_s + self.per_decode_s * num_decodes + self.per_prefill_token_s * prefill_tokens
                + self.per_attention_s * attention_pairs)


@dataclass
class SimRequest:
    arrival: float
    prompt_len: int
    output_len: int
    cached_len: int = 0  # prompt tokens the prefix cache would serve
    reserved_len: int = 0  # what a contiguous cache would reserve (prompt + max_tokens); 0 = prompt + output


class StepRow(NamedTuple):
    time: float
    running: int
    kv_tokens: int  # tokens whose K/V the running sequences hold (computed ones)
    waiting: int
    paged_tokens: int  # the same in whole blocks: what the paged cache holds
    reserved_tokens: int  # what contiguous prompt + max_tokens reservations would hold


@dataclass
class SimOutcome:
    ttft: float
    itl: float | None  # p99 of the request's inter-token gaps (a stall counts); None for 1-token outputs
    finish: float
    gaps: list[float] = field(default_factory=list, repr=False)


@dataclass
class SimResult:
    outcomes: list[SimOutcome]
    start: float
    end: float
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    timeline: list[StepRow] = field(default_factory=list)  # one row per step

    @property
    def makespan(self) -> float:
        return max(self.end - self.start, 1e-9)

    def goodput(self, slo_ttft_s: float, slo_itl_s: float) -> float:
        """Requests per second that met both objectives (TTFT, and the p99 of their inter-token gaps)."""
        return sum(meets_slo(o.ttft, o.itl, slo_ttft_s, slo_itl_s) for o in self.outcomes) / self.makespan

    def peak(self, column: str) -> int:
        return max((getattr(row, column) for row in self.timeline), default=0)

    def percentile(self, column: str, q: float) -> float:
        return percentile([getattr(row, column) for row in self.timeline], q)


def meets_slo(ttft: float, itl: float | None, slo_ttft_s: float, slo_itl_s: float) -> bool:
    """The request's first token came within the TTFT objective, and 99% of its later tokens
    within the ITL objective of the one before: a prefill chunk that stalls streaming decodes
    counts against the budget that let it (as Sarathi-Serve's time-between-tokens objective)."""
    return ttft <= slo_ttft_s and (itl is None or itl <= slo_itl_s)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class _Live:
    req: SimRequest
    index: int
    computed: int  # tokens whose KV exist
    produced: int = 0  # output tokens sampled
    first_token: float = 0.0
    last_token: float = 0.0
    gaps: list[float] = field(default_factory=list)
    credit: float = 0.0  # speculation: tokens owed by the average yield, not yet produced

    @property
    def total(self) -> int:
        return self.req.prompt_len + self.produced


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding as the simulation sees it: every decode verifies `proposed` draft
    tokens (they cost what prompt tokens cost) and yields `tokens_per_step` tokens on average."""

    tokens_per_step: float
    proposed: float


def simulate(requests: list[SimRequest], costs: StepCosts, max_num_batched_tokens: int, max_num_seqs: int,
             kv_capacity_tokens: int | None = None, block_size: int = 16,
             prefill_only: bool = False, speculation: Speculation | None = None) -> SimResult:
    """Run the trace through the continuous-batching policy with the cost model.

    prefill_only: every request stops after its first token (a prefill worker).
    kv_capacity_tokens: admission waits while the running batch would not fit (no preemption).
    speculation: decodes verify draft tokens and may yield several tokens a step.
    """
    max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    outcomes: list[SimOutcome | None] = [None] * len(requests)
    waiting: list[int] = []
    running: list[_Live] = []
    now = requests[order[0]].arrival if order else 0.0
    nxt = 0
    result = SimResult([], now, now)

    def blocks(tokens: int) -> int:
        return -(-tokens // block_size) * block_size

    while nxt < len(order) or waiting or running:
        while nxt < len(order) and requests[order[nxt]].arrival <= now:
            waiting.append(order[nxt])
            nxt += 1
        if not running and not waiting:
            now = requests[order[nxt]].arrival
            continue
        budget = max_num_batched_tokens
        decodes, prefill, chunks, pairs = 0, 0, [], 0.0
        for live in running:
            if budget == 0:
                break
            left = live.total - live.computed
            n = min(left, budget)
            if left == 1 and live.produced:
                decodes += 1
                if speculation is not None:
                    prefill += round(speculation.proposed)  # the draft tokens ride along, like prompt tokens
                    pairs += speculation.proposed * live.computed
            else:
                prefill += n
            pairs += n * (live.computed + n / 2)
            chunks.append((live, n))
            budget -= n
        held = sum(blocks(lv.total) for lv in running)
        while waiting and budget > 0 and len(running) < max_num_seqs:
            req = requests[waiting[0]]
            if kv_capacity_tokens is not None and running and held + blocks(req.prompt_len + 1) > kv_capacity_tokens:
                break
            i = waiting.pop(0)
            cached = min(req.cached_len, req.prompt_len - 1) // block_size * block_size
            live = _Live(req, i, computed=cached)
            running.append(live)
            n = min(req.prompt_len - cached, budget)
            prefill += n
            pairs += n * (cached + n / 2)
            chunks.append((live, n))
            budget -= n
            held += blocks(req.prompt_len + 1)
        dt = costs.step_time(prefill, decodes, pairs)
        # Split the step's time between prefill and decode by their variable costs.
        var_p, var_d = costs.per_prefill_token_s * prefill, costs.per_decode_s * decodes
        share = var_p / (var_p + var_d) if var_p + var_d > 0 else 0.0
        result.prefill_time_s += dt * share
        result.decode_time_s += dt * (1 - share)
        now += dt
        finished = []
        for live, n in chunks:
            decoding = live.produced > 0
            live.computed += n
            if live.computed < live.total:
                continue  # a prefill chunk that did not reach the end
            new = 1
            if decoding and speculation is not None:
                live.credit += speculation.tokens_per_step
                new = max(1, min(int(live.credit), live.req.output_len - live.produced))
                live.credit -= new
                live.computed += new - 1  # the accepted drafts' K/V were computed in the step
            live.produced += new
            if live.produced == new:
                live.first_token = now
            else:
                live.gaps += [(now - live.last_token) / new] * new
            live.last_token = now
            if live.produced >= (1 if prefill_only else live.req.output_len):
                finished.append(live)
        for live in finished:
            running.remove(live)
            itl = percentile(live.gaps, ITL_PERCENTILE) if live.gaps else None
            outcomes[live.index] = SimOutcome(live.first_token - live.req.arrival, itl, now, live.gaps)
        live_now = running + finished
        result.timeline.append(StepRow(
            now, len(live_now), sum(lv.computed for lv in live_now), len(waiting),
            sum(blocks(lv.computed) for lv in live_now),
            sum(lv.req.reserved_len or lv.req.prompt_len + lv.req.output_len for lv in live_now)))
    result.outcomes = [o for o in outcomes if o is not None]
    result.end = now
    return result


def simulate_disaggregated(requests: list[SimRequest], costs: StepCosts, max_num_batched_tokens: int,
                           max_num_seqs: int, transfer_s_per_token: float, num_prefill: int = 1,
                           num_decode: int = 1) -> SimResult:
    """Prefill workers compute prompts (and the first token), the KV travels, decode workers
    generate the rest. Requests are spread round-robin over the workers of each role."""
    first_tokens: list[float] = [0.0] * len(requests)
    prefill_time = decode_time = 0.0
    for w in range(num_prefill):
        idx = list(range(w, len(requests), num_prefill))
        if not idx:
            continue
        part = simulate([requests[i] for i in idx], costs, max_num_batched_tokens, max_num_seqs, prefill_only=True)
        prefill_time += part.prefill_time_s + part.decode_time_s
        for i, o in zip(idx, part.outcomes, strict=True):
            first_tokens[i] = requests[i].arrival + o.ttft
    # The decode worker receives the prompt's KV after the transfer and computes none of it
    # again: to it, each request is a 1-token prompt, whose one step produces the second token.
    handoff = [SimRequest(first_tokens[i] + transfer_s_per_token * r.prompt_len, 1, max(1, r.output_len - 1))
               for i, r in enumerate(requests)]
    outcomes: list[SimOutcome | None] = [None] * len(requests)
    for w in range(num_decode):
        idx = [i for i in range(w, len(requests), num_decode) if requests[i].output_len > 1]
        if not idx:
            continue
        part = simulate([handoff[i] for i in idx], costs, max_num_batched_tokens, max_num_seqs)
        decode_time += part.prefill_time_s + part.decode_time_s
        for i, o in zip(idx, part.outcomes, strict=True):
            r = requests[i]
            # The first gap spans the transfer and the wait for the decode worker.
            gaps = [handoff[i].arrival + o.ttft - first_tokens[i], *o.gaps]
            outcomes[i] = SimOutcome(first_tokens[i] - r.arrival, percentile(gaps, ITL_PERCENTILE), o.finish, gaps)
    for i, r in enumerate(requests):
        if outcomes[i] is None:
            outcomes[i] = SimOutcome(first_tokens[i] - r.arrival, None, first_tokens[i])
    start = min((r.arrival for r in requests), default=0.0)
    end = max((o.finish for o in outcomes), default=start)
    return SimResult(outcomes, start, end, prefill_time_s=prefill_time, decode_time_s=decode_time)


def simulate_replicas(requests: list[SimRequest], costs: StepCosts, max_num_batched_tokens: int,
                      max_num_seqs: int, replicas: int) -> SimResult:
    """`replicas` independent engines, requests spread round-robin."""
    outcomes: list[SimOutcome | None] = [None] * len(requests)
    prefill_time = decode_time = 0.0
    for w in range(replicas):
        idx = list(range(w, len(requests), replicas))
        if not idx:
            continue
        part = simulate([requests[i] for i in idx], costs, max_num_batched_tokens, max_num_seqs)
        prefill_time += part.prefill_time_s
        decode_time += part.decode_time_s
        for i, o in zip(idx, part.outcomes, strict=True):
            outcomes[i] = o
    done = [o for o in outcomes if o is not None]
    start = min((r.arrival for r in requests), default=0.0)
    end = max((o.finish for o in done), default=start)
    return SimResult(done, start, end, prefill_time_s=prefill_time, decode_time_s=decode_time)


def next_arrival_gaps(arrivals: list[float]) -> list[float]:
    s = sorted(arrivals)
    return [b - a for a, b in zip(s, s[1:], strict=False)]


def coefficient_of_variation(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0
