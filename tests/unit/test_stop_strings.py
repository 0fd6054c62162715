"""Stop strings and min_tokens: a stop string that appears before min_tokens is reached does not
count (vLLM's rule: stop conditions apply from min_tokens on), and streamed text always adds up
to the final text. Found by the differential fuzzer (tests/differential): the search for a stop
string started before the newly decoded text, so it found an occurrence from before min_tokens
and cut the final text shorter than what had already been streamed."""

from __future__ import annotations

import pytest

from tessera.engine.output_processor import SequenceTextState
from tessera.engine.request import Sequence, SequenceStatus
from tessera.model.tokenizer import Tokenizer
from tessera.model.weights import load_model_files
from tessera.sampling import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir, load_model_files(tiny_model_dir).config)


def feed(tokenizer: Tokenizer, text: str, params: SamplingParams) -> tuple[str, str, int]:
    """Append `text` one character token at a time as the engine does, streaming after each.
    Returns (streamed text, final text, tokens appended before the stop)."""
    seq = Sequence("r", tokenizer.encode("hi"), params)
    state = SequenceTextState(seq, tokenizer)
    streamed, n = "", 0
    for ch in text:
        ids = tokenizer.encode(ch, add_special_tokens=False)
        assert len(ids) == 1
        status = state.append_token(ids[0], set(), 10_000)
        n += 1
        out = state.make_output(None if status is None else status.finish_reason, False)
        streamed += out.delta_text
        if status is not None:
            assert status is SequenceStatus.FINISHED_STOPPED
            return streamed, out.text, n
    return streamed, state.make_output("length", False).text, n


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_before_min_tokens_is_ignored(tokenizer, include):
    params = SamplingParams(max_tokens=20, min_tokens=3, stop=["ab"], include_stop_str_in_output=include)
    streamed, final, n = feed(tokenizer, "abcxaby", params)
    # "ab" at tokens 1-2 comes before min_tokens=3; the one at tokens 5-6 stops the sequence.
    assert n == 6
    assert final == ("abcxab" if include else "abcx")
    assert streamed == final


def test_a_stop_string_completed_after_min_tokens_still_stops(tokenizer):
    # Begun before min_tokens (token 2 of 3), completed at token 3: it stops, as in vLLM.
    params = SamplingParams(max_tokens=20, min_tokens=3, stop=["xab"])
    streamed, final, n = feed(tokenizer, "zxabq", params)
    assert (n, final, streamed) == (4, "z", "z")
