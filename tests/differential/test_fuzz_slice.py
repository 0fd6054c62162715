"""The CI slice of the differential fuzzer: ~60 s of random cases in float32 on the tiny model.

Each run draws a new seed and prints it; rerun a failure with TESSERA_FUZZ_SEED=S (and the
printed minimal case with `python -m tests.differential --replay 'JSON'`). TESSERA_FUZZ_SECONDS
sets the budget. The long run is `python -m tests.differential --cases 2000`.
"""

from __future__ import annotations

import os
import random

from tessera.quant import invariant
from tests.differential.case import CHOICES
from tests.differential.execute import Context
from tests.differential.fuzz import fuzz

# int8 and int4 weights are batch-invariant only on the invariant kernel (tessera/quant/invariant.py,
# AVX-512 BF16 or AMX);
# elsewhere their torch kernels pick by row count, so they are drawn only where it runs.
CI_CHOICES = ({} if invariant.available() else
              {"quantization": [q for q in CHOICES["quantization"] if q not in ("int8", "int4")]})


def test_differential_fuzz_slice(tiny_model_dir):
    seed = int(os.environ.get("TESSERA_FUZZ_SEED", random.randrange(2**31)))
    budget = float(os.environ.get("TESSERA_FUZZ_SECONDS", "60"))
    print(f"differential fuzz seed {seed} (rerun: TESSERA_FUZZ_SEED={seed})")
    report = fuzz(Context(tiny_model_dir, "float32"), seed, budget_s=budget, choices=CI_CHOICES, max_shrinks=1,
                  stop_after_failure=True)
    print(report.format())
    assert report.cases > 0
    assert not report.failures, f"seed {seed}:\n{report.format()}"
