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

_warming = [False]  # the server's start-up warm-up runs freely: the gate counts served steps


def _ungated_warm_up(warm_up):
    def run(*args, **kwargs):
        _warming[0] = True
        try:
            return warm_up(*args, **kwargs)
        finally:
            _warming[0] = False

    return run


def _gated(step):
    gate = os.environ["TESSERA_TEST_GATE"]
    done = 0

    def gated_step(self):
        nonlocal done
        if _warming[0]:
            return step(self)
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
    import tessera.engine.warmup as warmup

    LLMEngine.step = _gated(LLMEngine.step)
    warmup.warm_up = _ungated_warm_up(warmup.warm_up)
    from tessera.cli import main

    sys.exit(main(sys.argv[1:]))
