"""SamplingParams: defaults, normalization, and validation errors that name the field."""

import subprocess
import sys

import pytest

from tessera.sampling import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature) == (1, 16, 0, 1.0)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.is_greedy and not p.uses_penalties


def test_stop_string_is_wrapped_and_lists_are_copied():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    stops = ["a", "b"]
    p = SamplingParams(stop=stops, stop_token_ids=(7, 8))
    stops.append("c")
    assert p.stop == ["a", "b"] and p.stop_token_ids == [7, 8]


def test_top_k_zero_means_off():
    assert SamplingParams(top_k=0).top_k == -1


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


def test_uses_penalties():
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties
    assert SamplingParams(frequency_penalty=0.5).uses_penalties


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("min_tokens", -1),
        ("temperature", -1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", -2.5),
        ("seed", "abc"),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["x"]),
        ("logprobs", -1),
        ("logprobs", 21),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_value_error_names_field_and_value(field, value):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    message = str(excinfo.value)
    assert message.startswith(f"{field} must be ")
    assert "got" in message and (repr(value) in message or str(value) in message)


def test_error_message_states_the_range():
    with pytest.raises(ValueError, match=r"temperature must be >= 0 .*got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=1000)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0),
        dict(top_p=1.0),
        dict(top_p=1e-9),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2, frequency_penalty=2),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(max_tokens=None),
        dict(seed=0),
        dict(max_tokens=1, min_tokens=1),
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_module_does_not_import_torch():
    code = "import sys, tessera.sampling; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
