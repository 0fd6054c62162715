"""A gate on LLMEngine.step for tests that must not race the model.

`StepGate(allowed=n)` patched in lets the first n steps run; after that each step returns no
outputs (the engine thread still applies adds and aborts, so nothing deadlocks) until `allow()`
raises the limit or `open()` removes it. A test thereby fixes how far a request has got when it
checks something (a disconnect, a timeout, a refusal), whatever the machine's speed.
"""

from __future__ import annotations

import threading
import time

import pytest

from tessera.engine.engine import LLMEngine


class StepGate:
    def __init__(self, allowed: int | None = 0) -> None:
        self.allowed = allowed
        self.done = 0  # real steps taken since the gate was installed
        self._lock = threading.Lock()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> StepGate:
        import tessera.engine.warmup as warmup

        real_step = LLMEngine.step
        real_warm_up = warmup.warm_up
        warming: set[int] = set()

        def warm_up_ungated(engine: LLMEngine, *args, **kwargs):
            # create_app's warm-up runs before any request: its steps are not the ones a test holds.
            warming.add(id(engine))
            try:
                return real_warm_up(engine, *args, **kwargs)
            finally:
                warming.discard(id(engine))

        def gated_step(engine: LLMEngine):
            if id(engine) in warming:
                return real_step(engine)
            with self._lock:
                go = self.allowed is None or self.done < self.allowed
                if go:
                    self.done += 1
            if not go:
                time.sleep(0.001)
                engine._last_step = (0, 0)  # a held step computed nothing: keep it out of the step histograms
                return []
            return real_step(engine)

        monkeypatch.setattr(LLMEngine, "step", gated_step)
        monkeypatch.setattr(warmup, "warm_up", warm_up_ungated)
        return self

    def allow(self, more: int) -> None:
        with self._lock:
            self.allowed = self.done + more

    def open(self) -> None:
        with self._lock:
            self.allowed = None

    def wait_done(self, steps: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.done < steps:
            assert time.monotonic() < deadline, f"only {self.done} of {steps} steps ran"
            time.sleep(0.005)


def wait_until(predicate, timeout: float = 30, what: str = "the condition") -> None:
    """Poll `predicate` until true (a bound for a hung server, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
