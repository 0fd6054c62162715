"""`tessera` with a gate on the engine's steps, for lifecycle tests that must not race the model.

Run as `python -m tests.gated_serve serve MODEL ...` with TESSERA_TEST_GATE=FILE: while FILE holds
a number N, the engine thread waits before its (N+1)-th step; without the file, steps run freely.
So a test decides how many tokens a request gets before an event (a SIGTERM), on any machine.
"""

from __future__ import annotations

import os
import sys
import time

from tessera.engine.engine import LLMEngine


def _gated(step):
    gate = os.environ["TESSERA_TEST_GATE"]
    done = 0

    def gated_step(self):
        nonlocal done
        while True:
            try:
                with open(gate) as f:
                    allowed = int(f.read().strip() or 0)
            except FileNotFoundError:
                break
            if done < allowed:
                break
            time.sleep(0.01)
        done += 1
        return step(self)

    return gated_step


if __name__ == "__main__":
    LLMEngine.step = _gated(LLMEngine.step)
    from tessera.cli import main

    sys.exit(main(sys.argv[1:]))
