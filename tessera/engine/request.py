"""A Sequence: one stream of tokens the engine generates, and its life-cycle state.

A request with `n > 1` fans out into n sequences at the front door (they share the prompt, and
prefix caching shares its KV blocks), so everything below the engine sees single sequences.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from tessera.sampling import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    index: int = 0  # which of the request's n samples this is
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache. A prefill chunk advances it by the chunk's length; the
    # last chunk (and every decode) also samples one new token.
    num_computed_tokens: int = 0
    # Prefix-cache hits counted when the sequence was admitted (tokens), for metrics.
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Per-token logprob entries, filled by the engine when sampling_params.logprobs is set.
    output_logprobs: list = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]
