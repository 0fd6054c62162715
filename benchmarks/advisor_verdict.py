"""The "autopilot never below the defaults" verdict of benchmarks/advisor.py, as a pure function.

Each run replays the defaults twice (first and last, the other configurations between), so the
run itself measures how far one configuration moves between two replays on the machine as it is.
The autopilot is judged against the better of the two defaults figures, with a tolerance equal to
their spread (as a share of the better one). That threshold is exactly the worse of the two
defaults figures: the autopilot is "not below the defaults" when it is no lower than a replay of
the defaults themselves scored in the same run. It says nothing finer than the run's own noise.
"""

from __future__ import annotations


def defaults_verdict(autopilot: float, defaults: list[float]) -> dict:
    """autopilot: its goodput; defaults: the goodput of each replay of the defaults (two or more).
    Returns the better defaults figure, the spread (max - min) / max, the raw ratio of the
    autopilot to the better defaults, the threshold (the better times 1 - spread) and `met`."""
    if len(defaults) < 2:
        raise ValueError(f"the verdict needs the defaults replayed at least twice, got {len(defaults)} run(s)")
    best, worst = max(defaults), min(defaults)
    spread = (best - worst) / best if best > 0 else 0.0
    threshold = best * (1.0 - spread)
    ratio = autopilot / best if best > 0 else (1.0 if autopilot == 0 else float("inf"))
    # A relative epsilon: best * (1 - (best - worst) / best) can land a rounding error below worst.
    return {"defaults": list(defaults), "best": best, "spread": spread, "ratio": ratio,
            "threshold": threshold, "met": autopilot >= threshold * (1 - 1e-12)}
