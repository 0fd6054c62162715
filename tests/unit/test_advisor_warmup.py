"""benchmarks/advisor.py's throw-away warm-up replay: it runs first, on the defaults, and is never
scored (not a row, not the best grid figure, not one of the defaults figures of the verdict); and
how several replays of one configuration become its row and the verdict's figures. The replays
are a fake that records its calls, so the order is checked, not timed."""

from __future__ import annotations

import pytest

from benchmarks import advisor as bench

DEFAULTS = bench.DEFAULTS
RUNS = [("grid", "pc=on budget=512", DEFAULTS),
        ("grid", "pc=off budget=128", {"enable_prefix_caching": False, "max_num_batched_tokens": 128}),
        ("autopilot", "autopilot from pc=on budget=512", DEFAULTS),
        ("defaults", "pc=on budget=512 (repeat)", DEFAULTS)]
ORDER = [0, 2, 1, 3]
# goodput per kind/name; the warm-up is far above every row, so scoring it would show
GOODPUT = {"warmup": 50.0, "pc=on budget=512": 2.0, "pc=off budget=128": 2.5,
           "autopilot from pc=on budget=512": 1.95, "pc=on budget=512 (repeat)": 1.9}


def fake_replay(calls: list):
    def replay_one(kind: str, name: str, cfg: dict) -> dict:
        calls.append((kind, name, dict(cfg)))
        g = GOODPUT["warmup" if kind == "warmup" else name]
        return {"goodput": g, "good": 8, "n": 8, "makespan_s": 8 / g}
    return replay_one


def test_the_warm_up_runs_first_on_the_defaults_then_the_order() -> None:
    calls: list = []
    rows, warm, _ = bench.measure(RUNS, ORDER, fake_replay(calls), warmup=True)
    assert [c[0] for c in calls] == ["warmup", "grid", "autopilot", "grid", "defaults"]
    assert calls[0][2] == DEFAULTS
    assert [c[1] for c in calls[1:]] == [RUNS[i][1] for i in ORDER]
    assert warm["ran"] and warm["goodput"] == 50.0 and warm["makespan_s"] == pytest.approx(8 / 50)


def test_the_warm_up_is_not_scored() -> None:
    rows, _, _ = bench.measure(RUNS, ORDER, fake_replay([]), warmup=True)
    assert len(rows) == len(RUNS) and all(r["kind"] != "warmup" for r in rows)
    assert rows[0]["goodput"] == 2.0  # the first defaults row is its own replay, not the warm-up's 50
    verdict = bench.score(rows)
    # defaults 2.0 (first) and 1.9 (last): spread 5%, worst 1.9; the autopilot's 1.95 is met
    assert verdict["defaults"] == [2.0, 1.9]
    assert verdict["spread"] == pytest.approx(0.05)
    assert verdict["met"]
    # the best grid figure is 2.5 (pc=off budget=128), so the first row is at 80%
    assert rows[0]["vs_best"] == pytest.approx(0.8)
    assert rows[2]["vs_defaults"] == pytest.approx(1.95 / 1.95)  # against the defaults' median, 1.95


def test_no_warm_up_when_switched_off() -> None:
    calls: list = []
    rows, warm, _ = bench.measure(RUNS, ORDER, fake_replay(calls), warmup=False)
    assert warm == {"ran": False}
    assert [c[1] for c in calls] == [RUNS[i][1] for i in ORDER]


def test_the_flag_defaults_to_on_and_switches_it_off() -> None:
    p = bench.build_parser()
    assert p.parse_args([]).warmup_replay is True
    assert p.parse_args(["--no-warmup-replay"]).warmup_replay is False


RUNS_N = [("grid", "pc=on budget=512", DEFAULTS),
          ("grid", "pc=off budget=128", {"enable_prefix_caching": False, "max_num_batched_tokens": 128}),
          ("autopilot", "autopilot from pc=on budget=512", DEFAULTS),
          ("defaults_between", "pc=on budget=512 (between)", DEFAULTS),
          ("defaults", "pc=on budget=512 (repeat)", DEFAULTS)]


def test_replays_the_autopilot_row_is_its_median_and_the_verdict_sees_every_replay() -> None:
    # Each name's replays score these figures in turn.
    figures = {"pc=on budget=512": [2.0, 2.2], "pc=off budget=128": [2.1, 2.4],
               "autopilot from pc=on budget=512": [1.5, 3.0, 1.7], "pc=on budget=512 (between)": [1.9, 2.1],
               "pc=on budget=512 (repeat)": [1.8, 2.3]}
    seen: dict[str, int] = {}

    def replay_one(kind: str, name: str, cfg: dict) -> dict:
        g = figures[name][seen.get(name, 0)]
        seen[name] = seen.get(name, 0) + 1
        return {"goodput": g, "good": 8, "n": 8, "makespan_s": 8 / g}

    order = [0, 2, 3, 1, 2, 3, 2, 4, 0, 1, 4]
    rows, _, replays = bench.measure(RUNS_N, order, replay_one, warmup=False)
    assert [len(replays[i]) for i in range(5)] == [2, 2, 3, 2, 2]
    assert rows[2]["goodput"] == 1.7 and rows[2]["replays"] == [1.5, 3.0, 1.7]  # the median, not the best 3.0
    assert rows[0]["goodput"] == 2.2 and rows[1]["goodput"] == 2.4  # grid rows keep their best
    verdict = bench.score(rows)
    assert sorted(verdict["defaults"]) == [1.8, 1.9, 2.0, 2.1, 2.2, 2.3]
    assert verdict["autopilot"] == [1.5, 3.0, 1.7]
    assert verdict["met"]  # 3.0 is above the worst defaults replay, 1.8
    assert verdict["ratio"] == pytest.approx(1.7 / 2.05)
    assert rows[2]["vs_best"] == pytest.approx(1.7 / 2.4)


def test_the_verdict_replays_flag() -> None:
    p = bench.build_parser()
    assert p.parse_args([]).verdict_replays == 3
    assert p.parse_args(["--verdict-replays", "1"]).verdict_replays == 1
