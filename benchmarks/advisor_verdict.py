"""The "autopilot never below the defaults" verdict of benchmarks/advisor.py, as a pure function.

Each run replays the defaults several times (first, last, and between the other configurations)
and the autopilot one or more times, interleaved, so the run itself measures how far one
configuration moves between replays on the machine as it is. The autopilot is "below the
defaults" only when every one of its replays scored lower than every replay of the defaults:
the one-sided exact rank test (Mann-Whitney U at its extreme). If the autopilot were exactly as
good as the defaults, all n + m figures would be exchangeable and that ordering would happen by
chance with probability 1 / C(n + m, n): 1/3 with one autopilot and two defaults replays (the
rule of sessions 6-14: the autopilot at or above the worse defaults replay), 1/35 with three
and four. The false "not met" of an autopilot equal to the defaults is that probability, which
is why a run replays both more than once. The ratio reported is the median autopilot replay
over the median defaults replay; `spread` is the defaults' (max - min) / max, the run's noise.
"""

from __future__ import annotations

import math
import statistics


def defaults_verdict(autopilot: float | list[float], defaults: list[float]) -> dict:
    """autopilot: the goodput of each autopilot replay (one number: one replay); defaults: the
    goodput of each replay of the defaults (two or more). Returns the defaults' best, worst,
    median and spread, the median autopilot / median defaults `ratio`, `chance` (the probability
    of the "below" ordering for two equal configurations) and `met`."""
    auto = [autopilot] if isinstance(autopilot, (int, float)) else list(autopilot)
    if len(defaults) < 2:
        raise ValueError(f"the verdict needs the defaults replayed at least twice, got {len(defaults)} run(s)")
    if not auto:
        raise ValueError("the verdict needs at least one autopilot replay")
    best, worst = max(defaults), min(defaults)
    spread = (best - worst) / best if best > 0 else 0.0
    mid_a, mid_d = statistics.median(auto), statistics.median(defaults)
    ratio = mid_a / mid_d if mid_d > 0 else (1.0 if mid_a == 0 else float("inf"))
    return {"autopilot": auto, "defaults": list(defaults), "best": best, "worst": worst, "median": mid_d,
            "spread": spread, "ratio": ratio, "chance": 1 / math.comb(len(auto) + len(defaults), len(auto)),
            "met": max(auto) >= worst}
