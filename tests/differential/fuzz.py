"""The fuzz loop: draw cases, add stop strings, run and check them, shrink failures, count coverage.

A run is reproducible from its seed: case i of a run with seed S is random_case(S * 1_000_003 + i).
Stop strings come from the reference text of the request itself (a substring of what it would
say), so that they actually fire; they are fixed into the case before it runs.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from tests.differential.case import Case, random_case
from tests.differential.execute import Context, Failure, run_case
from tests.differential.shrink import shrink


@dataclass
class Report:
    seed: int
    dtype: str
    cases: int = 0
    seconds: float = 0.0
    features: Counter = field(default_factory=Counter)  # active feature -> cases
    pairs: Counter = field(default_factory=Counter)  # (feature, feature) -> cases with both
    events: Counter = field(default_factory=Counter)  # event -> total over all cases
    cases_with: Counter = field(default_factory=Counter)  # event -> cases in which it happened
    failures: list[Failure] = field(default_factory=list)  # shrunk, one per distinct signature
    num_failing_cases: int = 0
    signatures: Counter = field(default_factory=Counter)  # (kind, minimal features) -> failing cases

    def format(self) -> str:
        lines = [f"differential fuzz: seed {self.seed}, dtype {self.dtype}: {self.cases} cases in "
                 f"{self.seconds:.0f} s, {self.num_failing_cases} failing",
                 "", "feature coverage (cases with the feature on):"]
        lines += [f"  {k:<28} {v}" for k, v in sorted(self.features.items())]
        lines += ["", "what the cases exercised (cases in which it happened / total):"]
        lines += [f"  {k:<28} {self.cases_with[k]:>6} / {v}" for k, v in sorted(self.events.items())]
        groups = sorted({k.split("=")[0] for k in self.features})
        lines += ["", "feature pairs seen together (cases with both on):"]
        by_group: Counter = Counter()
        for (x, y), v in self.pairs.items():
            by_group[tuple(sorted((x.split("=")[0], y.split("=")[0])))] += v
        lines.append(" " * 16 + "".join(f"{g[:7]:>8}" for g in groups))
        for a in groups:
            lines.append(f"  {a[:14]:<14}" + "".join(
                f"{by_group[tuple(sorted((a, b)))] if a != b else '-':>8}" for b in groups))
        if self.failures:
            lines += ["", "failures, by kind and the features the minimal case needs:"]
            for (kind, feats), n in self.signatures.most_common():
                lines.append(f"  {n:>5} x {kind}: {', '.join(feats) or '(plain engine)'}")
            lines += ["", "minimal cases (replay: python -m tests.differential --dtype DTYPE --replay 'JSON'):"]
            for f in self.failures:
                lines += [f"- {f.kind} [{', '.join(f.features) or 'plain'}] request {f.rid}: {f.message}",
                          f"  {f.case.to_json()}"]
        return "\n".join(lines)


def add_stop_strings(ctx: Context, case: Case, rng: random.Random, probability: float = 0.2) -> None:
    """Give some requests a stop string taken from their own reference output."""
    for r in case.requests:
        if rng.random() >= probability:
            continue
        text = ctx.reference(case.features, r.prompt, r.params)[0].text
        if len(text) >= 3:
            at = rng.randrange(1, len(text) - 1)
            r.params["stop"] = [text[at:at + rng.randint(1, 3)]]
            r.params["include_stop_str_in_output"] = rng.random() < 0.5


def fuzz(ctx: Context, seed: int, cases: int | None = None, budget_s: float | None = None,
         choices: dict[str, list] | None = None,
         max_shrinks: int = 6, stop_after_failure: bool = False, progress=None) -> Report:
    """Run `cases` cases, or as many as fit in budget_s seconds (shrinking included)."""
    report = Report(seed=seed, dtype=ctx.dtype)
    start = time.monotonic()
    seen: dict[tuple, Failure] = {}
    for i in itertools.count():
        if cases is not None and i >= cases:
            break
        if budget_s is not None and time.monotonic() - start > budget_s:
            break
        case_seed = seed * 1_000_003 + i
        case = random_case(case_seed, ctx.vocab, choices)
        add_stop_strings(ctx, case, random.Random(case_seed + 1))
        outcome = run_case(ctx, case)
        report.cases += 1
        active = case.features.active()
        report.features.update(active)
        report.pairs.update(itertools.combinations(sorted(active), 2))
        report.events.update(outcome.events)
        report.cases_with.update(k for k, v in outcome.events.items() if v)
        if outcome.failures:
            report.num_failing_cases += 1
            first = outcome.failures[0]
            if len(report.failures) < max_shrinks:
                _, first = shrink(ctx, first)
            else:
                first.features = active
            sig = (first.kind, tuple(first.features))
            report.signatures[sig] += 1
            if sig not in seen and len(report.failures) < max_shrinks:
                seen[sig] = first
                report.failures.append(first)
            if stop_after_failure:
                break
        if progress is not None and report.cases % 100 == 0:
            progress(f"{report.cases} cases, {report.num_failing_cases} failing, "
                     f"{time.monotonic() - start:.0f} s")
    report.seconds = time.monotonic() - start
    return report
