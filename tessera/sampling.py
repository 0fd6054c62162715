"""SamplingParams: how one request wants its tokens chosen and when generation stops.

Shaped like vLLM's, so OpenAI-style fields map one to one. Every field is checked when the object
is built, and a bad value raises ValueError naming the field, the value and the allowed range.
This module must stay free of torch: the HTTP server imports it to validate requests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tessera.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf/nan.
_GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RequestOutputKind(enum.IntEnum):
    """Which RequestOutputs a request gets (vLLM's names). CUMULATIVE and DELTA: one every step
    that adds to it (Tessera's outputs carry both the whole text and the step's delta, so the two
    behave alike here); FINAL_ONLY: only the finished one, which LLM.generate asks for. A
    FINAL_ONLY request without stop strings is detokenized once, when it finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: generate up to the model's context limit
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # how many top logprobs to return besides the sampled token
    skip_special_tokens: bool = True
    # A JSON schema, regex, choice or grammar the output must follow (tessera/structured).
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1  # 0 means "off" in the OpenAI-style APIs; keep one spelling inside
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1 or None (up to the context limit)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            fail("temperature", ">= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            fail("top_k", "-1 or 0 (off) or an integer >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "in [0, 1]")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            fail("repetition_penalty", "> 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                fail(name, "in [-2, 2]")
        # torch generators take 64-bit seeds; a larger one would fail inside the engine.
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            fail("seed", "an integer in [-2**63, 2**63) or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of integers >= 0")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "a bool")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", "a StructuredOutputsParams or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "a RequestOutputKind")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
