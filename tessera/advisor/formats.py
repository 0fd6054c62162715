"""Workload traces in the public formats, read into TraceRequests.

| format   | file   | fields used                                                         |
|----------|--------|---------------------------------------------------------------------|
| tessera  | JSONL  | see tessera/advisor/trace.py; `timestamp` (s) stands in for arrival |
| mooncake | JSONL  | timestamp (ms), input_length, output_length, hash_ids               |
| azure    | CSV    | TIMESTAMP (date-time), ContextTokens, GeneratedTokens               |
| burstgpt | CSV    | Timestamp (s), Request tokens, Response tokens                      |
| sharegpt | JSON   | [{"id", "conversations": [{"from", "value"}, ...]}, ...]            |

`detect_format` tells them apart by the file's first record; `load_trace(format=...)` names one.
Fields a format does not use are reported once, as one warning, and ignored: traces recorded by
other tools carry extra columns. A record that cannot be read stops the load with its line
number, unless `skip_bad_lines`, which skips it and says how many were skipped and where.

Only the lengths of the public traces are published, not their text, so prompts are
synthesised as token ids. Mooncake's `hash_ids` name 512-token blocks: every request holding a
hash id gets the same 512 tokens for that block (drawn from a generator seeded by the id), so
the prefix structure the trace records is the prefix structure the profiler and the prefix
cache see. Azure and BurstGPT record nothing shared: their prompts are unique random tokens.
Outputs are unknown in all three (only their lengths): requests run with max_tokens = the
recorded length and ignore_eos. ShareGPT conversations carry text: each human turn becomes a
chat request of the conversation so far, whose known output is the reply that followed.
"""

from __future__ import annotations

import csv
import difflib
import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import fields
from datetime import datetime
from pathlib import Path

from tessera.advisor.trace import TraceRequest
from tessera.sampling import SamplingParams

logger = logging.getLogger("tessera.advisor")

TRACE_FORMATS = ("tessera", "mooncake", "azure", "burstgpt", "sharegpt")
MOONCAKE_BLOCK_TOKENS = 512  # the block size of Mooncake's hash_ids
_MAX_LISTED_BAD_LINES = 5

# What synthesised prompts run with: greedy, every recorded output token generated.
_LENGTH_ONLY_SAMPLING = {"temperature": 0.0, "ignore_eos": True}

_TESSERA_KEYS = {"arrival_time", "timestamp", "prompt", "prompt_token_ids", "messages", "max_tokens",
                 "output_token_ids", "output", "id", "session"}
_SAMPLING_KEYS = {f.name for f in fields(SamplingParams)} - {"max_tokens"}
_MOONCAKE_KEYS = {"timestamp", "input_length", "output_length", "hash_ids"}
_AZURE_COLUMNS = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
_BURSTGPT_COLUMNS = {"Timestamp", "Request tokens", "Response tokens"}


class TraceFormatError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


class _Loader:
    """The state one load shares: unknown fields seen, bad lines skipped, token generation."""

    def __init__(self, path: Path, skip_bad_lines: bool, vocab_size: int, seed: int) -> None:
        self.path = path
        self.skip_bad_lines = skip_bad_lines
        self.unknown: set[str] = set()
        self.bad: list[tuple[int, str]] = []
        self.seed = seed
        # Leave the low ids (special tokens in most vocabularies) and the very top alone, as the
        # synthetic shapes do.
        self.lo, self.hi = min(100, vocab_size // 8), vocab_size - 1
        self.rng = random.Random(seed)

    def tokens(self, n: int, rng: random.Random | None = None) -> list[int]:
        r = rng or self.rng
        return [r.randint(self.lo, self.hi) for _ in range(n)]

    def records(self, items: Iterator[tuple[int, object]], parse: Callable[[object], TraceRequest | None]
                ) -> list[TraceRequest]:
        out = []
        for lineno, item in items:
            try:
                request = parse(item)
            except (ValueError, TypeError, KeyError) as exc:
                msg = str(exc) if not isinstance(exc, KeyError) else f"missing field {exc}"
                if not self.skip_bad_lines:
                    raise TraceFormatError(f"{self.path}:{lineno}: {msg} (--skip-bad-lines skips such lines)") from None
                self.bad.append((lineno, msg))
                continue
            if request is not None:
                out.append(request)
        return out

    def report(self, fmt: str) -> None:
        if self.unknown:
            logger.warning("%s: ignoring field(s) the %s format does not use: %s", self.path, fmt,
                           ", ".join(sorted(self.unknown)))
        if self.bad:
            listed = ", ".join(f"{n} ({m})" for n, m in self.bad[:_MAX_LISTED_BAD_LINES])
            more = f" and {len(self.bad) - _MAX_LISTED_BAD_LINES} more" if len(self.bad) > _MAX_LISTED_BAD_LINES else ""
            logger.warning("%s: skipped %d bad line(s) (--skip-bad-lines): line %s%s", self.path, len(self.bad),
                           listed, more)


# ---- detection --------------------------------------------------------------------------------


def detect_format(path: str | Path) -> str:
    """The format of a trace file, from its first record (CSV header, JSON array, JSONL object)."""
    path = Path(path)
    with open(path, newline="") as f:
        head = f.read(1 << 16)
    text = head.lstrip()
    if not text:
        raise TraceFormatError(f"{path}: the trace is empty")
    if text[0] == "[":
        return "sharegpt"
    if text[0] != "{":
        header = set(next(csv.reader([text.splitlines()[0]])))
        header = {h.strip() for h in header}
        if _AZURE_COLUMNS <= header:
            return "azure"
        if _BURSTGPT_COLUMNS <= header:
            return "burstgpt"
        raise TraceFormatError(
            f"{path}: not a trace format this reads (a CSV header needs {', '.join(sorted(_AZURE_COLUMNS))} (azure) "
            f"or {', '.join(sorted(_BURSTGPT_COLUMNS))} (burstgpt); JSONL one object a line); name one with "
            f"--trace-format {{{','.join(TRACE_FORMATS)}}}")
    first = text.splitlines()[0]
    try:
        obj = json.loads(first)
    except ValueError:
        return "tessera"  # its reader reports the bad line with its number
    if isinstance(obj, dict) and ("hash_ids" in obj or {"input_length", "output_length"} <= obj.keys()):
        return "mooncake"
    if isinstance(obj, dict) and "conversations" in obj:
        return "sharegpt"
    return "tessera"


def load_trace(path: str | Path, trace_format: str = "auto", skip_bad_lines: bool = False, vocab_size: int = 32000,
               seed: int = 0, rate: float = 1.0, tokenizer=None) -> list[TraceRequest]:
    """Read a trace of any format in TRACE_FORMATS ("auto": detect it), sorted by arrival and
    shifted so the first request arrives at 0. `vocab_size` and `seed` shape synthesised
    prompts; `rate` (conversations per second) and `tokenizer` (for max_tokens = the reply's
    length) serve ShareGPT, whose files carry no arrival times."""
    path = Path(path)
    fmt = detect_format(path) if trace_format == "auto" else trace_format
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"--trace-format {trace_format!r}: choose auto or one of {', '.join(TRACE_FORMATS)}")
    loader = _Loader(path, skip_bad_lines, vocab_size, seed)
    read = {"tessera": _read_tessera, "mooncake": _read_mooncake, "azure": _read_azure, "burstgpt": _read_burstgpt,
            "sharegpt": lambda ld: _read_sharegpt(ld, rate, tokenizer)}[fmt]
    requests = read(loader)
    loader.report(fmt)
    if not requests:
        raise TraceFormatError(f"{path}: the trace holds no requests" + (" (every line was bad)" if loader.bad else ""))
    requests.sort(key=lambda r: r.arrival_time)
    t0 = requests[0].arrival_time
    for r in requests:
        r.arrival_time -= t0
    return requests


def _jsonl(loader: _Loader) -> Iterator[tuple[int, object]]:
    with open(loader.path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                yield lineno, _BadLine(f"not JSON ({exc})")
                continue
            yield lineno, obj


class _BadLine:
    def __init__(self, message: str) -> None:
        self.message = message


def _object(item: object) -> dict:
    if isinstance(item, _BadLine):
        raise ValueError(item.message)
    if not isinstance(item, dict):
        raise ValueError(f"a trace line holds one JSON object, got {type(item).__name__}")
    return item


def _number(value: object, name: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not x >= minimum:  # also catches NaN
        raise ValueError(f"{name} must be >= {minimum:g}, got {value!r}")
    return x


def _count(value: object, name: str, minimum: int = 0) -> int:
    x = _number(value, name, minimum)
    if x != int(x):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(x)


# ---- tessera's own JSONL ----------------------------------------------------------------------


def _read_tessera(loader: _Loader) -> list[TraceRequest]:
    def parse(item: object) -> TraceRequest:
        d = dict(_object(item))
        if "arrival_time" not in d and "timestamp" in d:
            d["arrival_time"] = _timestamp_seconds(d["timestamp"])
        d.pop("timestamp", None)
        extra = set(d) - _TESSERA_KEYS - _SAMPLING_KEYS
        for key in extra:
            # A misspelt sampling parameter would silently change what runs: refuse it.
            close = difflib.get_close_matches(key, _SAMPLING_KEYS, n=1, cutoff=0.85)
            if close:
                raise ValueError(f"unknown sampling parameter {key!r}: did you mean {close[0]!r}?")
            d.pop(key)
        loader.unknown |= extra
        return TraceRequest.from_json(d)

    return loader.records(_jsonl(loader), parse)


def _timestamp_seconds(value: object) -> float:
    """A timestamp in seconds, or an ISO date-time (taken as seconds since the epoch)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return _parse_datetime(value)
    return _number(value, "timestamp")


def _parse_datetime(text: str) -> float:
    """Seconds since the epoch of a date-time such as Azure's "2023-11-16 18:15:46.6805900"
    (fromisoformat takes at most 6 fractional digits before Python 3.11, and not all after)."""
    text = text.strip()
    if "." in text:
        whole, frac = text.split(".", 1)
        digits = "".join(c for c in frac if c.isdigit())
        rest = frac[len(digits):]
        text = f"{whole}.{digits[:6].ljust(6, '0')}{rest}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"timestamp {text!r} is neither a number nor an ISO date-time") from None


# ---- Mooncake -----------------------------------------------------------------------------------


def _read_mooncake(loader: _Loader) -> list[TraceRequest]:
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            blocks[hash_id] = loader.tokens(MOONCAKE_BLOCK_TOKENS, random.Random(f"{loader.seed}/{hash_id}"))
        return blocks[hash_id]

    def parse(item: object) -> TraceRequest:
        d = _object(item)
        loader.unknown |= set(d) - _MOONCAKE_KEYS
        t = _number(d["timestamp"], "timestamp (ms)") / 1e3
        n_in = _count(d["input_length"], "input_length", 1)
        n_out = _count(d["output_length"], "output_length", 1)
        hash_ids = d.get("hash_ids", [])
        if not isinstance(hash_ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hash_ids):
            raise ValueError(f"hash_ids must be a list of integers, got {hash_ids!r}")
        if len(hash_ids) > -(-n_in // MOONCAKE_BLOCK_TOKENS):
            raise ValueError(f"{len(hash_ids)} hash_ids of {MOONCAKE_BLOCK_TOKENS} tokens do not fit input_length "
                             f"{n_in}")
        prompt = [tok for h in hash_ids for tok in block(h)][:n_in]
        prompt += loader.tokens(n_in - len(prompt))  # tokens past the hashed blocks are the request's own
        return TraceRequest(arrival_time=t, prompt_token_ids=prompt, max_tokens=n_out,
                            sampling=dict(_LENGTH_ONLY_SAMPLING))

    return loader.records(_jsonl(loader), parse)


# ---- Azure LLM inference trace and BurstGPT (CSV) ------------------------------------------------


def _csv_rows(loader: _Loader, required: set[str]) -> Iterator[tuple[int, object]]:
    with open(loader.path, newline="") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        header = {h.strip() for h in (reader.fieldnames or [])}
        missing = required - header
        if missing:
            raise TraceFormatError(f"{loader.path}:1: the CSV header lacks {', '.join(sorted(missing))}")
        loader.unknown |= header - required
        for row in reader:
            row = {(k or "").strip(): v for k, v in row.items()}
            if None in row.values() or "" in row:  # too few or too many columns
                yield reader.line_num, _BadLine(f"expected {len(header)} columns")
                continue
            yield reader.line_num, row


def _length_request(loader: _Loader, t: float, n_in: int, n_out: int) -> TraceRequest:
    return TraceRequest(arrival_time=t, prompt_token_ids=loader.tokens(n_in), max_tokens=n_out,
                        sampling=dict(_LENGTH_ONLY_SAMPLING))


def _read_azure(loader: _Loader) -> list[TraceRequest]:
    def parse(item: object) -> TraceRequest:
        if isinstance(item, _BadLine):
            raise ValueError(item.message)
        t = _timestamp_seconds(item["TIMESTAMP"])
        return _length_request(loader, t, _count(item["ContextTokens"], "ContextTokens", 1),
                               _count(item["GeneratedTokens"], "GeneratedTokens", 1))

    return loader.records(_csv_rows(loader, _AZURE_COLUMNS), parse)


def _read_burstgpt(loader: _Loader) -> list[TraceRequest]:
    failed = 0

    def parse(item: object) -> TraceRequest | None:
        nonlocal failed
        if isinstance(item, _BadLine):
            raise ValueError(item.message)
        t = _number(item["Timestamp"], "Timestamp (s)")
        n_in = _count(item["Request tokens"], "Request tokens", 0)
        n_out = _count(item["Response tokens"], "Response tokens", 0)
        if n_out == 0 or n_in == 0:
            failed += 1  # BurstGPT logs failed requests with 0 tokens: nothing to replay
            return None
        return _length_request(loader, t, n_in, n_out)

    out = loader.records(_csv_rows(loader, _BURSTGPT_COLUMNS), parse)
    if failed:
        logger.warning("%s: left out %d request(s) with 0 request or response tokens (failed in the original "
                       "service)", loader.path, failed)
    return out


# ---- ShareGPT-shaped conversations ---------------------------------------------------------------

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant", "system": "system"}
_THINK_TIME_S = 8.0  # between a reply and the next human turn of the same conversation


def _read_sharegpt(loader: _Loader, rate: float, tokenizer) -> list[TraceRequest]:
    if rate <= 0:
        raise ValueError(f"ShareGPT conversations need a rate > 0 (conversations per second), got {rate}")
    text = loader.path.read_text()
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except ValueError as exc:
            # json reports the line of the fault within the file
            raise TraceFormatError(f"{loader.path}:{getattr(exc, 'lineno', '?')}: not JSON ({exc})") from None
        items = _array_items(text, data)
    else:
        items = _jsonl(loader)
    t = 0.0
    starts = random.Random(loader.seed)
    out: list[TraceRequest] = []

    def parse(item: object) -> None:
        nonlocal t
        d = _object(item)
        turns = d["conversations"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("conversations must be a non-empty list of {from, value} turns")
        loader.unknown |= set(d) - {"id", "conversations"}
        messages, requests = [], []
        for turn in turns:
            role = _ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
            if role is None or not isinstance(turn.get("value"), str):
                raise ValueError(f"a turn needs 'from' (one of {', '.join(sorted(_ROLES))}) and a text 'value', "
                                 f"got {turn!r}")
            if role == "assistant" and messages and messages[-1]["role"] == "user":
                requests.append((list(messages), turn["value"]))
            messages.append({"role": role, "content": turn["value"]})
        if messages[-1]["role"] == "user":
            requests.append((list(messages), None))  # the last question, unanswered in the file
        arrival = t
        for i, (history, reply) in enumerate(requests):
            max_tokens = len(tokenizer.encode(reply, add_special_tokens=False)) if tokenizer and reply else None
            out.append(TraceRequest(arrival_time=arrival, messages=history, max_tokens=max_tokens or None,
                                    output=reply, id=f"{d.get('id', 'conv')}-{i}", session=str(d.get("id", "")) or None,
                                    sampling=dict(_LENGTH_ONLY_SAMPLING) if max_tokens else {}))
            arrival += _THINK_TIME_S
        t += starts.expovariate(rate)

    loader.records(items, parse)
    return out


def _array_items(text: str, data: object) -> Iterator[tuple[int, object]]:
    """The array's elements with the line each starts on (for error messages)."""
    if not isinstance(data, list):
        raise TraceFormatError("a ShareGPT file holds one JSON array of conversations")
    decoder, pos, line = json.JSONDecoder(), text.index("[") + 1, 1 + text[: text.index("[")].count("\n")
    for item in data:
        while text[pos] in " \t\r\n,":
            line += text[pos] == "\n"
            pos += 1
        _, end = decoder.raw_decode(text, pos)
        yield line, item
        line += text[pos:end].count("\n")
        pos = end
