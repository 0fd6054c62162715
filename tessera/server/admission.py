"""What the server refuses before the engine sees a request: admission control and request limits.

- `ServerLimits`: every limit in one place, from the `tessera serve` flags.
- `AdmissionController`: counts the sequences the server has accepted and not yet answered, and
  turns new work away with a 503 and `Retry-After` at once when the queue behind a full batch is
  long enough (`--max-waiting-requests`) or holds enough prompt tokens still to prefill
  (`--max-waiting-tokens`), instead of letting the queue and everyone's latency grow without
  bound. The count is the server's own, taken synchronously on the event loop, so a burst of
  concurrent requests cannot slip past it between engine steps.
- `check_request_limits`: n, prompts per request, stop strings, stop token ids, timeout.
- `RequestBodyGuard`: an ASGI middleware that answers 413 for a body over `--max-body-bytes`
  (before reading it when Content-Length says so), 415 for a body that is not JSON and 400 for one
  that is not UTF-8, so the routes only ever parse bounded, decodable JSON.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tessera.server.errors import APIError, error_response

# JSON bodies only: what the routes parse. Other methods (GET, OPTIONS preflights) pass untouched.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True)
class ServerLimits:
    """Limits of one server; None means no limit."""

    # Sequences (n x prompts of each request) accepted beyond one full batch (--max-num-seqs).
    max_waiting_requests: int | None = 256
    # Prompt tokens of accepted sequences that have not produced their first token yet.
    max_waiting_tokens: int | None = None
    request_timeout: float | None = None  # seconds from arrival; caps the request's own `timeout`
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    max_prompts: int = 64  # prompts in one completions request
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # characters in one stop string
    max_stop_token_ids: int = 64
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for flag, value in (("--max-waiting-requests", self.max_waiting_requests),
                            ("--max-waiting-tokens", self.max_waiting_tokens)):
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0 (or unset for no limit), got {value}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")

    def timeout_for(self, requested: float | None) -> float | None:
        """The request's deadline in seconds: its own `timeout`, capped by --request-timeout."""
        limits = [t for t in (requested, self.request_timeout) if t is not None]
        return min(limits) if limits else None


def check_request_limits(limits: ServerLimits, *, n: int, num_prompts: int, stop: Sequence[str],
                         stop_token_ids: Sequence[int], vocab_size: int, timeout: float | None) -> None:
    """Raise a 400 APIError naming the field for anything beyond the server's per-request limits."""
    if n > limits.max_n:
        raise APIError(400, f"n is {n}, more than this server's limit of {limits.max_n} choices per request",
                       param="n", code="invalid_value")
    if num_prompts > limits.max_prompts:
        raise APIError(400, f"the request has {num_prompts} prompts, more than this server's limit of "
                            f"{limits.max_prompts}; send them in several requests", param="prompt",
                       code="invalid_value")
    if len(stop) > limits.max_stop:
        raise APIError(400, f"stop has {len(stop)} strings, more than the limit of {limits.max_stop}",
                       param="stop", code="invalid_value")
    long = next((s for s in stop if len(s) > limits.max_stop_chars), None)
    if long is not None:
        raise APIError(400, f"a stop string has {len(long)} characters, more than the limit of "
                            f"{limits.max_stop_chars}", param="stop", code="invalid_value")
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise APIError(400, f"stop_token_ids has {len(stop_token_ids)} ids, more than the limit of "
                            f"{limits.max_stop_token_ids}", param="stop_token_ids", code="invalid_value")
    bad = next((t for t in stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"stop_token_ids: token id {bad} is out of the vocabulary (0..{vocab_size - 1})",
                       param="stop_token_ids", code="invalid_value")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise APIError(400, f"timeout must be a number of seconds > 0, got {timeout!r}", param="timeout",
                       code="invalid_value")


# ---- admission ----------------------------------------------------------------------------------


class Ticket:
    """One accepted HTTP request's share of the server: its sequences, and its prompt tokens while
    it waits. Each prompt leaves the queue at its first output; `release` gives everything back."""

    def __init__(self, controller: AdmissionController, n: int, prompt_lens: Sequence[int]) -> None:
        self.controller = controller
        self.num_seqs = n * len(prompt_lens)
        self._queued = {i: (n, n * length) for i, length in enumerate(prompt_lens)}  # prompt -> (seqs, tokens)
        self.released = False

    def started(self, prompt_index: int) -> None:
        seqs_tokens = self._queued.pop(prompt_index, None)
        if seqs_tokens is not None and not self.released:
            self.controller._leave_queue(*seqs_tokens)

    def timed_out(self) -> None:
        self.controller.num_timeouts += 1

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for seqs, tokens in self._queued.values():
            self.controller._leave_queue(seqs, tokens)
        self._queued.clear()
        self.controller.in_flight_seqs -= self.num_seqs


class AdmissionController:
    """Accepts or refuses requests by the work already accepted (event-loop side only).

    A request is refused while others are in flight when taking it would leave more than
    `max_waiting_requests` sequences queued behind a full batch of `batch_size`, or more than
    `max_waiting_tokens` prompt tokens waiting for their prefill. A request that exceeds a limit on
    its own is still taken when nothing is in flight (nothing queued, for the token limit), so
    that no valid request is refused forever.
    """

    def __init__(self, limits: ServerLimits, batch_size: int) -> None:
        self.limits = limits
        self.batch_size = batch_size
        self.in_flight_seqs = 0
        self.queued_seqs = 0
        self.queued_tokens = 0
        self.rejected: Counter[str] = Counter()
        self.num_timeouts = 0

    def admit(self, n: int, prompt_lens: Sequence[int]) -> Ticket:
        """A Ticket for the request, or a 503 APIError (with Retry-After) when the server is full."""
        lim = self.limits
        seqs = n * len(prompt_lens)
        tokens = n * sum(prompt_lens)
        if self.in_flight_seqs > 0:
            waiting_after = self.in_flight_seqs + seqs - self.batch_size
            if lim.max_waiting_requests is not None and waiting_after > lim.max_waiting_requests:
                self._refuse("waiting_requests",
                             f"{max(0, self.in_flight_seqs - self.batch_size)} sequences are already waiting "
                             f"for a batch slot and this request adds {seqs} (--max-waiting-requests "
                             f"{lim.max_waiting_requests}, --max-num-seqs {self.batch_size})")
        if self.queued_tokens > 0 and lim.max_waiting_tokens is not None:
            if self.queued_tokens + tokens > lim.max_waiting_tokens:
                self._refuse("waiting_tokens",
                             f"{self.queued_tokens} prompt tokens are already waiting for their prefill and this "
                             f"request adds {tokens} (--max-waiting-tokens {lim.max_waiting_tokens})")
        self.in_flight_seqs += seqs
        self.queued_seqs += seqs
        self.queued_tokens += tokens
        return Ticket(self, n, prompt_lens)

    def _refuse(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        raise APIError(503, f"the server is at capacity: {detail}; retry after {self.limits.retry_after_s} s",
                       code="server_overloaded", headers={"Retry-After": str(self.limits.retry_after_s)})

    def _leave_queue(self, seqs: int, tokens: int) -> None:
        self.queued_seqs -= seqs
        self.queued_tokens -= tokens


class AdmissionCollector(Collector):
    """The controller's gauges and counters, read when Prometheus scrapes."""

    def __init__(self, controller: AdmissionController, model_name: str) -> None:
        self.controller = controller
        self.model_name = model_name

    def collect(self):
        c, name = self.controller, self.model_name
        for metric, doc, value in (
            ("tessera:server_in_flight_seqs", "Sequences the server accepted and has not answered yet.",
             c.in_flight_seqs),
            ("tessera:server_queued_seqs", "Accepted sequences without their first output yet.", c.queued_seqs),
            ("tessera:server_queued_prompt_tokens", "Prompt tokens of the queued sequences.", c.queued_tokens),
        ):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            yield g
        rejected = CounterMetricFamily("tessera:requests_rejected", "Requests refused with 503 by admission control.",
                                       labels=["model_name", "reason"])
        for reason in ("waiting_requests", "waiting_tokens"):
            rejected.add_metric([name, reason], c.rejected[reason])
        yield rejected
        timeouts = CounterMetricFamily("tessera:request_timeouts", "Requests aborted at their timeout.",
                                       labels=["model_name"])
        timeouts.add_metric([name], c.num_timeouts)
        yield timeouts


# ---- the body guard -----------------------------------------------------------------------------


class RequestBodyGuard:
    """ASGI middleware: bounded, JSON, UTF-8 request bodies, or an OpenAI-style error at once.

    The body is read here (at most `max_body_bytes`) and replayed to the app, followed by the
    client's later messages, so the routes still see the disconnect of a client that leaves.
    """

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        if content_type and not _is_json(content_type):
            await self._reject(scope, receive, send, APIError(
                415, f"the body must be JSON sent with 'Content-Type: application/json', got {content_type!r}",
                code="unsupported_media_type"))
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                declared_len = int(declared)
            except ValueError:
                declared_len = -1
            if declared_len < 0:
                await self._reject(scope, receive, send, APIError(400, "the Content-Length header is not a number"))
                return
            if declared_len > self.max_body_bytes:
                await self._reject(scope, receive, send, self._too_large(declared_len))
                return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._reject(scope, receive, send, self._too_large(None))
                return
            if not message.get("more_body", False):
                break
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            await self._reject(scope, receive, send, APIError(
                400, f"the body is not valid UTF-8 (byte {exc.start}); JSON must be UTF-8", code="invalid_json"))
            return
        lone = lone_surrogate_escape(text)
        if lone is not None:
            await self._reject(scope, receive, send, APIError(
                400, f"the body's JSON has a lone UTF-16 surrogate escape {text[lone:lone + 6]!r} at character "
                     f"{lone}: it is no Unicode character (a surrogate is valid only as a high-low pair)",
                code="invalid_json"))
            return
        if not content_type:  # a client that names no type gets its body read as JSON
            scope = dict(scope, headers=[*scope["headers"], (b"content-type", b"application/json")])
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int | None) -> APIError:
        got = f"{size} bytes" if size is not None else "more"
        return APIError(413, f"the request body is too large: {got}, the limit is {self.max_body_bytes} bytes "
                             f"(--max-body-bytes)", code="body_too_large")

    @staticmethod
    async def _reject(scope, receive, send, exc: APIError) -> None:
        await error_response(exc)(scope, receive, send)


# A JSON escape: `\\` (an escaped backslash) or `\uXXXX`. Scanning left to right with this
# pattern pairs every backslash with what it escapes, so `\\ud800` (a backslash, then text) is
# not taken for an escape.
_ESCAPE = re.compile(r"\\(?:\\|u([0-9a-fA-F]{4}))")
_MAYBE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def lone_surrogate_escape(text: str) -> int | None:
    """Where the first `\uD800`-`\uDFFF` escape that is not part of a high-low pair starts, or None.

    json.loads turns such an escape into a lone surrogate, a str that no tokenizer (and no UTF-8
    encoder) accepts; so it is refused here as invalid input (RFC 8259 section 8.2).
    """
    if not _MAYBE_SURROGATE.search(text):
        return None
    high_at: int | None = None  # where a high surrogate waiting for its low half starts
    high_end = -1
    for m in _ESCAPE.finditer(text):
        unit = int(m.group(1), 16) if m.group(1) else None
        is_low = unit is not None and 0xDC00 <= unit <= 0xDFFF
        if high_at is not None:
            if is_low and m.start() == high_end:
                high_at = None
                continue
            return high_at
        if unit is None:
            continue
        if 0xD800 <= unit <= 0xDBFF:
            high_at, high_end = m.start(), m.end()
        elif is_low:
            return m.start()
    return high_at


def _is_json(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))
