"""Workload traces: the JSONL format, its reader and writer, a server-side recorder, and
synthetic generators for the common shapes of traffic.

One request per line, in any order (readers sort by arrival time):

    {"arrival_time": 0.25,                       seconds from the start of the trace
     "prompt": "..." | "prompt_token_ids": [...] | "messages": [{"role": ..., "content": ...}],
     "max_tokens": 64,
     "temperature": 0.0, "top_p": 1.0, ...       any other SamplingParams field, flat
     "output_token_ids": [...], "output": "..."  optional: what the model answered, when known
     "id": "...", "session": "..."}              optional: request id, conversation id

Exactly one of prompt / prompt_token_ids / messages. `timestamp` (seconds, or an ISO date-time)
stands in for a missing arrival_time; other fields are ignored with one warning per file. Known outputs feed the speculative
decoding estimate (how often an n-gram drawn from the context predicts the next tokens).
The synthetic generators write token ids, so a trace is independent of any tokenizer.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

from tessera.sampling import SamplingParams

_PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
_SAMPLING_KEYS = {f.name for f in fields(SamplingParams)} - {"max_tokens"}


@dataclass
class TraceRequest:
    arrival_time: float
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = 16
    sampling: dict = field(default_factory=dict)  # the other SamplingParams fields given
    output_token_ids: list[int] | None = None
    output: str | None = None
    id: str | None = None
    session: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _PROMPT_KEYS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a trace request needs exactly one of {', '.join(_PROMPT_KEYS)}; got {given or 'none'}")
        if self.arrival_time < 0:
            raise ValueError(f"arrival_time must be >= 0 seconds, got {self.arrival_time}")
        unknown = set(self.sampling) - _SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {sorted(unknown)}; known: {sorted(_SAMPLING_KEYS)}")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, **self.sampling)

    def to_json(self) -> dict:
        d: dict = {"arrival_time": round(self.arrival_time, 6)}
        for key in _PROMPT_KEYS:
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        d["max_tokens"] = self.max_tokens  # null: up to the context limit
        d.update(self.sampling)
        for key in ("output_token_ids", "output", "id", "session"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    @classmethod
    def from_json(cls, d: dict) -> TraceRequest:
        d = dict(d)
        known = {k: d.pop(k) for k in ("arrival_time", *_PROMPT_KEYS, "max_tokens", "output_token_ids", "output",
                                       "id", "session") if k in d}
        if "arrival_time" not in known:
            raise ValueError("a trace request needs arrival_time (seconds from the start of the trace)")
        return cls(**known, sampling=d)


def read_trace(path: str | Path, trace_format: str = "auto", skip_bad_lines: bool = False,
               **kwargs) -> list[TraceRequest]:
    """Read a trace (this JSONL, or a public format: see tessera/advisor/formats.py), sorted by
    arrival time and shifted so the first request arrives at 0."""
    from tessera.advisor.formats import load_trace

    return load_trace(path, trace_format, skip_bad_lines, **kwargs)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r.to_json()) + "\n")


def prompt_token_ids(request: TraceRequest, tokenizer=None) -> list[int]:
    """The request's prompt as token ids; text and chat prompts need the model's tokenizer."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if tokenizer is None:
        raise ValueError("the trace has text or chat prompts: give --model so they can be tokenized")
    if request.messages is not None:
        return tokenizer.encode(tokenizer.apply_chat_template(request.messages), add_special_tokens=False)
    return tokenizer.encode(request.prompt)


# ---- recording from the server ------------------------------------------------------------------


class TraceRecorder:
    """Appends one line per served engine request to a JSONL file, when it finishes or is aborted
    (so the line carries the output the model gave). A StepObserver for the engine thread, plus
    `record_add`, which the engine's front door calls as requests come in."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._pending: dict[str, TraceRequest] = {}
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a crash loses at most one line

    def record_add(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float) -> None:
        sampling = {k: getattr(params, k) for k in _SAMPLING_KEYS
                    if getattr(params, k) != getattr(_DEFAULT_PARAMS, k)}
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        entry = TraceRequest(arrival_time=max(0.0, arrival_time - self._start), prompt=text, prompt_token_ids=ids,
                             max_tokens=params.max_tokens, sampling=sampling, id=request_id)
        with self._lock:
            self._pending[request_id] = entry

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def on_step(self, outputs, stats, now: float) -> None:
        for out in outputs:
            if out.finished:
                self._write(out.request_id, out.outputs[0].token_ids if out.outputs else None)

    def on_abort(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            self._write(rid, None)

    def _write(self, request_id: str, output_ids: list[int] | None) -> None:
        with self._lock:
            entry = self._pending.pop(request_id, None)
            if entry is None:
                return
            entry.output_token_ids = list(output_ids) if output_ids is not None else None
            self._file.write(json.dumps(entry.to_json()) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


_DEFAULT_PARAMS = SamplingParams()


def record_requests(engine, recorder: TraceRecorder) -> None:
    """Make an AsyncLLMEngine tell `recorder` about every request it is given (before the engine
    thread can finish it); a refused request is forgotten again."""
    add_request = engine.add_request

    async def recording_add_request(request_id, prompt, params, arrival_time=None):
        recorder.record_add(request_id, prompt, params, time.monotonic() if arrival_time is None else arrival_time)
        try:
            return await add_request(request_id, prompt, params, arrival_time)
        except BaseException:
            recorder.forget(request_id)
            raise

    engine.add_request = recording_add_request


class FanOutObserver:
    """Several StepObservers behind the engine's one observer slot (metrics, recorder, autopilot)."""

    def __init__(self, *observers) -> None:
        self.observers = [o for o in observers if o is not None]

    def on_step(self, outputs, stats, now: float) -> None:
        for o in self.observers:
            o.on_step(outputs, stats, now)

    def on_abort(self, request_ids: list[str], now: float) -> None:
        for o in self.observers:
            o.on_abort(request_ids, now)


# ---- synthetic traces ---------------------------------------------------------------------------

SHAPES = ("chatbot", "multiturn", "summarization", "code_edit", "mixed", "bursty", "random")


def synthesize(shape: str, num_requests: int = 64, rate: float = 8.0, seed: int = 0, vocab_size: int = 32000,
               length_scale: float = 1.0) -> list[TraceRequest]:
    """A synthetic trace of `shape` (see SHAPES): token-id prompts, known outputs, Poisson arrivals
    at `rate` requests/s (bursty: bursts at that mean rate). `length_scale` shrinks or stretches
    every length, so the same shape fits a tiny test model or a real one."""
    if shape not in _GENERATORS:
        raise ValueError(f"unknown trace shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if num_requests < 1 or rate <= 0:
        raise ValueError(f"need num_requests >= 1 and rate > 0, got {num_requests} and {rate}")
    g = _Gen(random.Random(seed), vocab_size, length_scale)
    return _GENERATORS[shape](g, num_requests, rate)


class _Gen:
    def __init__(self, rng: random.Random, vocab_size: int, scale: float) -> None:
        self.rng = rng
        # Leave the low ids (special tokens in most vocabularies) and the very top alone.
        self.lo, self.hi = min(100, vocab_size // 8), vocab_size - 1
        self.scale = scale

    def n(self, tokens: float) -> int:
        return max(1, round(tokens * self.scale))

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randint(self.lo, self.hi) for _ in range(n)]

    def arrivals(self, count: int, rate: float) -> list[float]:
        t, out = 0.0, []
        for _ in range(count):
            out.append(t)
            t += self.rng.expovariate(rate)
        return out


def _request(t: float, prompt: list[int], output: list[int], **kw) -> TraceRequest:
    return TraceRequest(arrival_time=t, prompt_token_ids=prompt, max_tokens=len(output), output_token_ids=output,
                        sampling={"temperature": 0.0, "ignore_eos": True}, **kw)


def _chatbot(g: _Gen, count: int, rate: float) -> list[TraceRequest]:
    """One long system prompt (90% of every prompt) shared by all, a short user turn each."""
    system = g.tokens(g.n(360))
    return [_request(t, system + g.tokens(g.n(g.rng.randint(24, 56))), g.tokens(g.n(g.rng.randint(32, 96))))
            for t in g.arrivals(count, rate)]


def _multiturn(g: _Gen, count: int, rate: float) -> list[TraceRequest]:
    """Conversations of several turns: each turn's prompt is the last prompt + its answer + a new
    user message; conversations start at `rate`, turns follow after a few seconds of thought."""
    out: list[TraceRequest] = []
    turns = 4
    starts = g.arrivals(-(-count // turns), rate / turns)
    for c, start in enumerate(starts):
        history, t = g.tokens(g.n(64)), start
        for _ in range(turns):
            if len(out) == count:
                break
            prompt = history + g.tokens(g.n(g.rng.randint(16, 48)))
            answer = g.tokens(g.n(g.rng.randint(32, 80)))
            out.append(_request(t, prompt, answer, session=f"conv-{c}"))
            history = prompt + answer
            t += g.rng.uniform(0.5, 1.5) / max(rate, 1e-9) * turns
    return sorted(out, key=lambda r: r.arrival_time)


def _summarization(g: _Gen, count: int, rate: float) -> list[TraceRequest]:
    """Long unique documents, short summaries."""
    return [_request(t, g.tokens(g.n(g.rng.randint(600, 1200))), g.tokens(g.n(g.rng.randint(24, 64))))
            for t in g.arrivals(count, rate)]


def _code_edit(g: _Gen, count: int, rate: float) -> list[TraceRequest]:
    """An instruction and a file; the answer is the file again with a few lines changed, so most
    output tokens copy runs of the prompt (what n-gram speculation predicts well)."""
    out = []
    for t in g.arrivals(count, rate):
        code = g.tokens(g.n(g.rng.randint(160, 320)))
        answer = list(code)
        for _ in range(3):  # three small edits
            at = g.rng.randrange(len(answer))
            answer[at : at + 4] = g.tokens(4)
        out.append(_request(t, g.tokens(g.n(24)) + code, answer))
    return out


def _mixed(g: _Gen, count: int, rate: float) -> list[TraceRequest]:
    """Mostly short chat turns with a few long prompts and long answers among them."""
    out = []
    for t in g.arrivals(count, rate):
        if g.rng.random() < 0.2:
            out.append(_request(t, g.tokens(g.n(g.rng.randint(600, 1200))), g.tokens(g.n(g.rng.randint(96, 192)))))
        else:
            out.append(_request(t, g.tokens(g.n(g.rng.randint(16, 64))), g.tokens(g.n(g.rng.randint(8, 32)))))
    return out


def _bursty(g: _Gen, count: int, rate: float) -> list[TraceRequest]:
    """Bursts of 8 to 16 requests at the same instant, quiet in between; uniform lengths."""
    out: list[TraceRequest] = []
    t = 0.0
    while len(out) < count:
        size = min(g.rng.randint(8, 16), count - len(out))
        out += [_request(t, g.tokens(g.n(128)), g.tokens(g.n(64))) for _ in range(size)]
        t += g.rng.expovariate(rate / size)
    return out


def _random(g: _Gen, count: int, rate: float) -> list[TraceRequest]:
    """Uniform lengths, nothing shared, nothing copied: the control shape."""
    return [_request(t, g.tokens(g.n(128)), g.tokens(g.n(64))) for t in g.arrivals(count, rate)]


_GENERATORS = {
    "chatbot": _chatbot,
    "multiturn": _multiturn,
    "summarization": _summarization,
    "code_edit": _code_edit,
    "mixed": _mixed,
    "bursty": _bursty,
    "random": _random,
}


def main(argv: list[str] | None = None) -> int:
    """python -m tessera.advisor.trace SHAPE -o FILE: write a synthetic trace."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tessera.advisor.trace", description="write a synthetic trace (JSONL)")
    p.add_argument("shape", choices=SHAPES)
    p.add_argument("-o", "--output", required=True)
    p.add_argument("-n", "--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (bursty: the mean rate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply every prompt and output length")
    args = p.parse_args(argv)
    write_trace(args.output, synthesize(args.shape, args.num_requests, args.rate, args.seed, args.vocab_size,
                                        args.length_scale))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
