"""Shrinking a failing case to a minimal one: fewer requests, plainer features, simpler params.

Greedy delta debugging: each simplification is kept if the case still fails the same way (the
same failure kind). What survives names the features the failure needs, which is what a
report to the kernel or scheduler owner must say.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tests.differential.case import PLAIN, Case, Features
from tests.differential.execute import Context, Failure, run_case

_PLAIN_ALL = PLAIN | dict(kv_cache_dtype="auto", quantization="none")
_OPTIONAL_PARAMS = ("stop", "stop_token_ids", "min_tokens", "repetition_penalty", "logprobs", "top_k", "top_p",
                    "min_p", "n")


def shrink(ctx: Context, failure: Failure, max_runs: int = 80) -> tuple[Case, Failure]:
    """The smallest case found (within max_runs reruns) that still fails with failure.kind."""
    best, best_failure = failure.case, failure
    runs = 0

    def still_fails(candidate: Case) -> bool:
        nonlocal best, best_failure, runs
        if runs >= max_runs or not candidate.requests:
            return False
        runs += 1
        found = [f for f in run_case(ctx, candidate).failures if f.kind == failure.kind]
        if found:
            best, best_failure = candidate, found[0]
        return bool(found)

    for _ in range(2):  # a second pass: a removal may enable another
        _each(best.requests, lambda r: still_fails(replace(best, requests=[x for x in best.requests if x is not r])))
        for name, plain in _PLAIN_ALL.items():
            if getattr(best.features, name) != plain:
                still_fails(_with_feature(best, name, plain))
        for i in range(len(best.requests)):
            for simpler in _simpler_requests(best.requests[i]):
                still_fails(replace(best, requests=best.requests[:i] + [simpler] + best.requests[i + 1:]))
    best_failure.case = best
    best_failure.features = best.features.active()
    return best, best_failure


def _each(items: list, attempt: Callable) -> None:
    for item in list(reversed(items)):
        attempt(item)


def _with_feature(case: Case, name: str, value) -> Case:
    f = replace(case.features, **{name: value})
    if name == "swap_space" and not value:
        f = replace(f, preemption="recompute")
    return replace(case, features=Features(**vars(f)))


def _simpler_requests(r):
    if r.arrival_step:
        yield replace(r, arrival_step=0)
    if r.abort_after is not None:
        yield replace(r, abort_after=None)
    for key in _OPTIONAL_PARAMS:
        if key in r.params:
            yield replace(r, params={k: v for k, v in r.params.items() if k != key})
    if len(r.prompt) > 8:
        yield replace(r, prompt=r.prompt[len(r.prompt) // 2:])
