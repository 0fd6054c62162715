"""benchmarks/advisor_verdict.py: the autopilot is below the defaults only when every one of its
replays scored under every defaults replay (the one-sided exact rank test). Figures worked by hand."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "advisor_verdict.py"
_spec = importlib.util.spec_from_file_location("advisor_verdict", _PATH)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
defaults_verdict = _mod.defaults_verdict


def test_one_replay_each_side_is_judged_against_the_worse_defaults_replay() -> None:
    # defaults 2.00 and 1.90: 1.90 equals the worse replay (met), 1.89 is under both (not met)
    assert defaults_verdict(1.90, [1.90, 2.00])["met"]
    v = defaults_verdict(1.89, [1.90, 2.00])
    assert not v["met"]
    assert v["spread"] == pytest.approx(0.05)
    assert v["median"] == pytest.approx(1.95)
    assert v["ratio"] == pytest.approx(1.89 / 1.95)
    assert v["chance"] == pytest.approx(1 / 3)


def test_one_autopilot_replay_at_or_above_the_worst_is_enough() -> None:
    # medians 1.85 and 2.00 (ratio 92.5%): not every autopilot replay is under 1.95, so met
    v = defaults_verdict([1.80, 1.85, 1.95], [2.00, 1.95, 2.05, 2.00])
    assert v["met"]
    assert v["ratio"] == pytest.approx(1.85 / 2.00)
    assert v["worst"] == 1.95
    assert v["chance"] == pytest.approx(1 / 35)


def test_every_autopilot_replay_under_every_defaults_replay_is_not_met() -> None:
    v = defaults_verdict([1.80, 1.85, 1.94], [2.00, 1.95, 2.05, 2.00])
    assert not v["met"]
    assert v["autopilot"] == [1.80, 1.85, 1.94]


def test_identical_defaults_leave_no_tolerance() -> None:
    v = defaults_verdict(2.99, [3.00, 3.00])
    assert v["spread"] == 0.0
    assert not v["met"]
    assert defaults_verdict(3.00, [3.00, 3.00])["met"]


def test_above_the_defaults_reports_the_ratio_of_medians() -> None:
    v = defaults_verdict([2.20, 2.40], [2.00, 1.60])  # spread 20%, medians 2.30 and 1.80
    assert v["ratio"] == pytest.approx(2.30 / 1.80)
    assert v["spread"] == pytest.approx(0.20)
    assert v["met"]


def test_too_few_replays_are_refused() -> None:
    with pytest.raises(ValueError, match="at least twice"):
        defaults_verdict(1.0, [1.0])
    with pytest.raises(ValueError, match="at least one autopilot"):
        defaults_verdict([], [1.0, 1.0])


def test_zero_defaults_goodput() -> None:
    assert defaults_verdict(0.0, [0.0, 0.0])["met"]
    assert defaults_verdict(0.5, [0.0, 0.0])["ratio"] == float("inf")


@pytest.mark.parametrize(("n", "m"), [(1, 2), (3, 4)])
def test_an_autopilot_equal_to_the_defaults_fails_at_the_chance_the_verdict_reports(n: int, m: int) -> None:
    # n + m identically distributed figures: the n autopilot ones are all the lowest with
    # probability 1 / C(n + m, n) (1/3 and 1/35). The docs quote these rates; check on 30000 draws.
    rng = random.Random(0)
    draws = 30000
    fails = sum(not defaults_verdict([rng.gauss(10, 0.3) for _ in range(n)],
                                     [rng.gauss(10, 0.3) for _ in range(m)])["met"] for _ in range(draws))
    p = 1 / math.comb(n + m, n)
    assert abs(fails / draws - p) < 5 * math.sqrt(p * (1 - p) / draws)
