"""The OpenMP team a thread leaves behind is released (tessera.engine.openmp_team): otherwise the
loading thread's team stays beside the engine thread's and libgomp stops spinning its workers."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import tessera.engine.async_engine as async_engine
import tessera.engine.step_thread as step_thread
from tessera.engine.openmp_team import _loaded_runtime, release_calling_thread_team

needs_two_threads = pytest.mark.skipif((os.cpu_count() or 1) < 2 or _loaded_runtime() is None,
                                       reason="needs 2 CPUs and torch's OpenMP runtime")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@needs_two_threads
def test_release_frees_the_worker_threads_a_thread_started():
    counts = {}

    def work():
        threads = torch.get_num_threads()
        torch.set_num_threads(2)  # ATen's count is process-wide: put back below
        counts["before"] = _threads()
        torch.ones(1 << 22).add_(1)  # an at::parallel_for region: the team's worker starts
        counts["with team"] = _threads()
        counts["released"] = release_calling_thread_team()
        counts["after"] = _threads()
        torch.ones(1 << 22).add_(1)  # the next region starts a team again
        counts["again"] = _threads()
        release_calling_thread_team()
        torch.set_num_threads(threads)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert counts["released"] is True
    assert counts["with team"] == counts["before"] + 1
    assert counts["after"] == counts["before"]
    assert counts["again"] == counts["before"] + 1


def test_the_async_engine_releases_the_loading_threads_team_before_its_thread_starts(monkeypatch):
    """... and tunes malloc then too (tessera.engine.malloc_tuning, tests/unit/test_malloc_tuning.py)."""
    seen = []

    class FakeEngine:
        def stats(self):
            return None

        def has_unfinished_requests(self):
            return False

    monkeypatch.setattr(step_thread, "release_calling_thread_team",
                        lambda: seen.append((threading.current_thread(), threading.active_count())))
    monkeypatch.setattr(step_thread, "keep_freed_memory", lambda: seen.append(("malloc", threading.active_count())))
    before = threading.active_count()
    engine = async_engine.AsyncLLMEngine(FakeEngine(), idle_poll_s=0.01)
    try:
        # on this thread, the engine's not started yet
        assert seen == [(threading.current_thread(), before), ("malloc", before)]
    finally:
        engine.shutdown()


def test_the_disagg_worker_does_both_before_its_engine_thread_starts(monkeypatch, tiny_model_dir):
    # EngineWorker (a Ray actor's class) loads its engine on the calling thread and steps it on
    # one of its own, as AsyncLLMEngine does.
    import tessera.disagg.worker as worker
    from tessera.config import EngineConfig

    seen = []
    monkeypatch.setattr(step_thread, "release_calling_thread_team",
                        lambda: seen.append(("team", threading.current_thread(), threading.active_count())))
    monkeypatch.setattr(step_thread, "keep_freed_memory",
                        lambda: seen.append(("malloc", threading.current_thread(), threading.active_count())))
    before = threading.active_count()
    w = worker.EngineWorker(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    try:
        me = threading.current_thread()
        assert seen == [("team", me, before), ("malloc", me, before)]
        assert threading.active_count() == before + 1  # and then the engine thread
    finally:
        w.shutdown()


@needs_two_threads
def test_a_loaded_engine_leaves_no_team_on_the_loading_thread(tiny_model_dir):
    # A web app loads the model on one thread and generates on its workers: the loading
    # thread's team must not stay beside theirs.
    from tessera.config import EngineConfig
    from tessera.engine.engine import LLMEngine

    counts = {}

    def load():
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        counts["before"] = _threads()
        torch.ones(1 << 22).add_(1)
        counts["with team"] = _threads()
        counts["engine"] = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_threads=2))
        counts["after"] = _threads()
        torch.set_num_threads(threads)

    t = threading.Thread(target=load)
    t.start()
    t.join()
    assert counts["with team"] == counts["before"] + 1
    assert counts["after"] == counts["before"]


def test_passive_wait_policy_is_named_once(monkeypatch, caplog):
    import tessera.engine.openmp_team as team

    monkeypatch.setattr(team, "_warned_passive", False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    with caplog.at_level("WARNING", logger="tessera"):
        assert team.warn_if_passive() is False
        assert not caplog.records
        monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
        assert team.warn_if_passive() is True
        assert team.warn_if_passive() is True
    assert len(caplog.records) == 1 and "OMP_WAIT_POLICY=PASSIVE" in caplog.records[0].getMessage()
