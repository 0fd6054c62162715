"""Turning sampled token ids into text, stop decisions and RequestOutput deltas.

One `SequenceTextState` per sequence: incremental detokenization, stop strings (the text is cut
before the stop string, which is never streamed: text that could still become a stop string is
held back), and the part of the text already handed to the caller, so streamed deltas always add
up to the final text.
"""

from __future__ import annotations

from tessera.engine.request import Sequence, SequenceStatus
from tessera.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tessera.outputs import CompletionOutput, Logprob, TokenLogprobs
from tessera.sampling import RequestOutputKind


class SequenceTextState:
    def __init__(self, seq: Sequence, tokenizer: Tokenizer) -> None:
        self.seq = seq
        params = seq.sampling_params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, seq.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.stop_strings = list(params.stop or [])
        # Nobody reads the text before the end (FINAL_ONLY) and no stop string needs it: the tokens
        # wait in `pending` and are decoded once when the sequence finishes.
        self.deferred = params.output_kind == RequestOutputKind.FINAL_ONLY and not self.stop_strings
        self.pending: list[int] = []
        self.text = ""  # all text decoded so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of self.text already handed out
        self.emitted_tokens = 0
        self.emitted_logprobs = 0
        self.stop_reason: int | str | None = None

    def resume(self, emitted_text_len: int) -> None:
        """Take over a sequence that already has outputs (from another engine): decode them, and
        count as handed out the text, tokens and logprobs the client already got."""
        seq = self.seq
        for token_id in seq.output_token_ids:  # one at a time, as they were first decoded
            self.text += self.detokenizer.append(token_id)
        self.emitted = min(emitted_text_len, len(self.text))
        self.emitted_tokens = seq.num_output_tokens
        self.emitted_logprobs = len(seq.output_logprobs)

    def append_token(self, token_id: int, eos_token_ids: set[int], max_model_len: int) -> SequenceStatus | None:
        """Record a sampled token; return the finished status if the sequence is done."""
        self.seq.output_token_ids.append(token_id)
        new_from = len(self.text)
        if self.deferred:
            self.pending.append(token_id)
        else:
            self.text += self.detokenizer.append([token_id])
        status = self._check_finished(token_id, eos_token_ids, max_model_len, new_from)
        if status is not None and self.pending:
            self.text += self.detokenizer.append(self.pending)
            self.pending = []
        if status is not None and not isinstance(self.stop_reason, str):
            self.text += self.detokenizer.flush()  # release an incomplete character at the very end
        return status

    def _check_finished(self, token_id: int, eos_token_ids: set[int], max_model_len: int,
                        new_from: int) -> SequenceStatus | None:
        seq = self.seq
        params = seq.sampling_params
        num_out = seq.num_output_tokens
        past_min = num_out >= params.min_tokens
        if past_min and not params.ignore_eos and token_id in eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if past_min and token_id in (params.stop_token_ids or ()):
            self.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        if past_min and self.stop_strings and self._check_stop_strings(new_from):
            return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _check_stop_strings(self, new_from: int) -> bool:
        # Only a match that ends in the text this token added counts (text from new_from on):
        # an earlier one was either checked already or came before min_tokens, when stop
        # strings do not apply (and may have been streamed already).
        for stop in self.stop_strings:
            at = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1:
                keep = at + len(stop) if self.seq.sampling_params.include_stop_str_in_output else at
                self.text = self.text[:keep]
                self.stop_reason = stop
                return True
        return False

    def _releasable_len(self, finished: bool) -> int:
        """How much text may be handed out: all of it, less a tail that may begin a stop string."""
        if finished or not self.stop_strings:
            return len(self.text)
        hold = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return len(self.text) - hold

    def make_output(self, finish_reason: str | None, with_logprobs: bool) -> CompletionOutput:
        seq = self.seq
        end = self._releasable_len(finish_reason is not None)
        delta_text = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        tokens = seq.output_token_ids
        delta_tokens = tokens[self.emitted_tokens :]
        self.emitted_tokens = len(tokens)
        logprobs = delta_logprobs = None
        if with_logprobs:
            logprobs = list(seq.output_logprobs)  # a snapshot: the engine thread keeps appending
            delta_logprobs = logprobs[self.emitted_logprobs :]
            self.emitted_logprobs = len(logprobs)
        return CompletionOutput(
            index=seq.index,
            text=self.text[: self.emitted],
            token_ids=list(tokens),
            finish_reason=finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
            delta_logprobs=delta_logprobs,
        )


def decode_logprobs(entry: TokenLogprobs | None, tokenizer: Tokenizer) -> TokenLogprobs | None:
    """Fill in each token's text; only requests that asked for logprobs pay for it."""
    if entry is None:
        return None
    return {
        tid: Logprob(lp.logprob, lp.rank, tokenizer.decode([tid], skip_special_tokens=False))
        for tid, lp in entry.items()
    }
