"""Step costs fitted from the steps an engine really ran: what each step computed and how long it took.

`tessera profile` times a few synthetic steps once (profile.measure_step_costs). That probe can
miss how the model behaves at the chunk sizes and batch mixes a workload really gives, and on a
shared machine the cores' speed moves between the probe and the run (the C++ kernels made a
bf16 decode step 2-3x faster in one session; a neighbour's build slows every step by half).
This module closes the gap from observation:

- `StepRecorder` wraps `engine.step()`: before the step it notes every scheduled-to-be sequence's
  computed tokens, after it reads what the step computed (the engine's own token count and wall
  time), and keeps one `StepSample` per step: prefill tokens, decodes, attention pairs, seconds.
- `fit_step_costs` fits the advisor's cost model `base + per_decode x D + per_token x P +
  per_pair x pairs` to those samples by non-negative least squares, trimming the steps a busy
  machine slowed (large positive residuals), and keeps the probe's figure for a term the samples
  cannot tell apart (no decode-only steps, say). The fit also reports how much slower than
  modelled the steps ran at a bad moment (`StepCosts.slowdown`, the p90 of observed / fitted
  step time): a request's p99 gap over a few dozen tokens is one of its slowest steps, so the
  advisor scores budgets and speculation at the fitted costs and at that slowdown of them.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, replace

import numpy as np

from tessera.advisor.sim import StepCosts, percentile

# Fewer samples than this: keep the probe's costs (a fit of four terms needs a spread of steps).
MIN_SAMPLES = 12
# The slowdown reported with a fit: this percentile of observed / modelled step time.
SLOWDOWN_PERCENTILE = 90
# A step whose time exceeds the fit by more than this many robust standard deviations (1.4826 x
# the median absolute residual) was slowed by something else; it is left out and the fit redone.
TRIM_SIGMAS = 3.0
TRIM_ROUNDS = 3


@dataclass(frozen=True)
class StepSample:
    prefill_tokens: int  # prompt tokens computed in the step (prefix-cache hits are not computed)
    num_decodes: int  # sequences that decoded one token
    attention_pairs: float  # (query token, key) pairs attention read, as sim.StepCosts counts them
    time_s: float  # the engine's wall time of the step


class StepRecorder:
    """Step an engine and record what each step computed. Speculative steps (draft tokens) do not
    fit the plain cost model and are not recorded; everything else is."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.samples: list[StepSample] = []

    def step(self):
        sched = self.engine.scheduler
        before = {id(s): (s, s.num_computed_tokens, s.num_tokens, s.num_output_tokens)
                  for s in (*sched.running, *sched.waiting)}
        outputs = self.engine.step()
        stats = self.engine.stats()
        computed = stats.last_step_num_tokens
        if computed and getattr(self.engine, "spec", None) is None:
            sample = _composition(before.values(), computed, stats.last_step_time_s)
            if sample is not None:
                self.samples.append(sample)
        return outputs


def _composition(before, computed_tokens: int, time_s: float) -> StepSample | None:
    decodes, pairs, chunks = 0, 0.0, []
    for seq, done, total, produced in before:
        delta = seq.num_computed_tokens - done
        if delta <= 0:
            continue  # not scheduled, or preempted (its KV dropped)
        if produced and done == total - 1 and delta == 1:
            decodes += 1
            pairs += done + 1  # the new token attends to every cached key and itself
        else:
            chunks.append((seq.num_computed_tokens, delta))
    prefill = computed_tokens - decodes
    if prefill < 0:
        return None
    hit_and_computed = sum(d for _, d in chunks)
    for end, delta in chunks:
        # A sequence admitted with prefix-cache hits advanced by hits + computed; the step's own
        # count says how many were computed: spread that over the chunks by their advance.
        n = delta * prefill / hit_and_computed if hit_and_computed else 0.0
        pairs += n * (end - n + n / 2)  # n tokens starting at end - n, as sim.simulate counts them
    return StepSample(prefill, decodes, pairs, time_s)


def _design(samples: list[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array([[1.0, s.num_decodes, s.prefill_tokens, s.attention_pairs] for s in samples])
    return a, np.array([s.time_s for s in samples])


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |a x - y| subject to x >= 0, exactly, for a handful of columns: the optimum is the
    unconstrained least-squares solution on some subset of the columns (the others at 0), so
    every subset is tried and the best feasible one kept."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((sub @ x - y) ** 2))
            if err < best_err - 1e-18:
                best, best_err = np.zeros(n), err
                best[list(cols)] = x
    return best


def fit_step_costs(samples: list[StepSample], prior: StepCosts) -> StepCosts:
    """The cost model fitted to observed steps (see the module docstring); `prior` (the probe's
    measurement) supplies a term the samples do not vary, and is returned when they are too few."""
    if len(samples) < MIN_SAMPLES:
        return prior
    a, y = _design(samples)
    # A term that never varies beyond its smallest value cannot be told from the base: fix it at
    # the prior and fit the rest (no decode-only steps, no prefill, no long contexts ...).
    priors = np.array([prior.base_s, prior.per_decode_s, prior.per_prefill_token_s, prior.per_attention_s])
    free = [0] + [j for j in (1, 2, 3) if np.ptp(a[:, j]) > 0]
    fixed = [j for j in range(4) if j not in free]
    keep = np.ones(len(y), dtype=bool)
    x = priors.copy()
    for _ in range(TRIM_ROUNDS + 1):
        target = y[keep] - a[keep][:, fixed] @ priors[fixed]
        x[free] = nonnegative_lstsq(a[keep][:, free], target)
        resid = y - a @ x
        scale = 1.4826 * float(np.median(np.abs(resid[keep]))) or 1e-12
        new_keep = resid <= TRIM_SIGMAS * scale
        if np.array_equal(new_keep, keep) or new_keep.sum() < MIN_SAMPLES:
            break
        keep = new_keep
    base, per_decode, per_token, per_pair = (float(v) for v in x)
    x[0] = max(base, 1e-6)
    # Every step counts here, the trimmed ones too: they are what a request's slowest gaps see.
    ratios = [float(r) for r in y / (a @ x)]
    slowdown = max(1.0, percentile(ratios, SLOWDOWN_PERCENTILE))
    return replace(prior, base_s=float(x[0]), per_decode_s=per_decode, per_prefill_token_s=per_token,
                   per_attention_s=per_pair, slowdown=slowdown,
                   source=f"fitted to {int(keep.sum())} of {len(samples)} observed steps "
                          f"(median {statistics.median(s.time_s for s in samples) * 1e3:.1f} ms, "
                          f"p{SLOWDOWN_PERCENTILE} {slowdown:.2f}x the fit)")
