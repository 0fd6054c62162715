"""`python -m tests.differential --cases 2000 [--dtype bfloat16] [--seed S]`: the long fuzz run.

Prints the seed, the feature coverage, what the cases exercised and every distinct failure as
a minimal case; `--replay 'JSON'` reruns one case and prints its failures. Exit status 1 when
anything failed. The model is the tiny random one (tests/tiny_model.py) unless --model-dir.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile

import torch

from tests.differential.case import CHOICES, Case
from tests.differential.execute import Context, run_case
from tests.differential.fuzz import fuzz


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.differential", description=__doc__)
    ap.add_argument("--cases", type=int, default=None, help="cases to run (default: until --budget-s)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--seed", type=int, default=None, help="the run's seed (default: random, printed)")
    ap.add_argument("--dtype", default="float32", help="the model dtype: float32 or bfloat16")
    ap.add_argument("--only", action="append", default=[], metavar="FEATURE=V1,V2",
                    help="draw FEATURE only from these values, e.g. quantization=none,w8a8 (repeatable)")
    ap.add_argument("--max-shrinks", type=int, default=6, help="distinct failures to shrink and print")
    ap.add_argument("--model-dir", default=None, help="a model folder (default: the tiny random model)")
    ap.add_argument("--replay", default=None, help="a case's JSON, as a failure printed it")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.cases is None and args.budget_s is None and args.replay is None:
        ap.error("give --cases N, --budget-s S or --replay JSON")
    torch.set_num_threads(args.threads)
    logging.getLogger("tessera").setLevel(logging.WARNING)
    model_dir = args.model_dir
    if model_dir is None:
        from tests.tiny_model import make_tiny_model_dir

        model_dir = make_tiny_model_dir(tempfile.mkdtemp(prefix="tessera-fuzz-"))
    ctx = Context(model_dir, args.dtype)
    if args.replay is not None:
        outcome = run_case(ctx, Case.from_json(args.replay))
        for f in outcome.failures:
            print(f"{f.kind} request {f.rid}: {f.message}")
        print(f"events: {dict(outcome.events)}")
        return 1 if outcome.failures else 0
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {seed} (reproduce: python -m tests.differential --seed {seed} --dtype {args.dtype} ...)", flush=True)
    choices = {}
    for spec in args.only:
        name, _, values = spec.partition("=")
        if name not in CHOICES:
            ap.error(f"--only {spec}: unknown feature {name!r}; features: {', '.join(CHOICES)}")
        choices[name] = [_parse(v, CHOICES[name]) for v in values.split(",")]
    report = fuzz(ctx, seed, cases=args.cases, budget_s=args.budget_s, choices=choices,
                  max_shrinks=args.max_shrinks, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(report.format())
    return 1 if report.failures else 0


def _parse(value: str, allowed: list):
    """A feature value as its type in CHOICES ("8" -> 8, "True" -> True)."""
    for a in allowed:
        if str(a) == value:
            return a
    raise SystemExit(f"--only: {value!r} is not one of {allowed}")


if __name__ == "__main__":
    sys.exit(main())
