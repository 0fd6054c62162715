"""A `tessera serve` subprocess on loopback for load tests: start, probe, measure, stop.

The server runs in its own process so that its resident memory (VmRSS) is its own, and the
load generator (tessera.bench.load) runs in the caller's. Engine state after a run is read from
/metrics: sequences running and waiting, KV cache usage, the server's in-flight count.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m tessera.cli serve MODEL_DIR ...` on a free loopback port."""

    def __init__(self, model_dir: Path, *flags: str, num_threads: int = 1) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "tessera.cli", "serve", str(model_dir), "--port", str(self.port),
                    "--dtype", "float32", "--max-model-len", "256", "--served-model-name", MODEL,
                    "--num-threads", str(num_threads), "--no-access-log", "--log-level", "warning",
                    "--no-warmup",  # the warm-up has its own tests (test_warmup.py)
                    "--no-kv-prefault",  # RSS is measured here: only requests may move it (test_kv_prefault.py)
                    *flags]
        self.proc: subprocess.Popen | None = None
        self.log: list[str] = []
        self._rss_peak_kib = 0
        self._sampling = False

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited at start:\n" + "".join(self.log[-40:]))
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up in 90 s:\n" + "".join(self.log[-40:]))
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.stop()

    def _drain(self) -> None:
        for line in self.proc.stdout:  # keep the pipe from filling; keep the tail for error messages
            self.log.append(line)
            del self.log[:-200]

    def stop(self, timeout: float = 30) -> int:
        self._sampling = False
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    # ---- measurements -------------------------------------------------------------------------

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS line")

    def sample_rss_peak(self, period_s: float = 0.1) -> None:
        """Track the highest RSS from now until stop_sampling() in a background thread."""
        self._rss_peak_kib = self.rss_kib()
        self._sampling = True

        def loop() -> None:
            while self._sampling and self.proc.poll() is None:
                self._rss_peak_kib = max(self._rss_peak_kib, self.rss_kib())
                time.sleep(period_s)

        threading.Thread(target=loop, daemon=True).start()

    def stop_sampling(self) -> int:
        self._sampling = False
        return self._rss_peak_kib

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics without labels other than model_name, by sample name; labelled
        samples as `name{label=value}`."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                extra = {k: v for k, v in s.labels.items() if k != "model_name"}
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else "")
                out[key] = s.value
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """/metrics once nothing runs, waits or is in flight (or the last reading at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if is_idle(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


def is_idle(m: dict[str, float]) -> bool:
    return (m["tessera:num_requests_running"] == 0 and m["tessera:num_requests_waiting"] == 0
            and m["tessera:kv_cache_usage_perc"] == 0 and m["tessera:server_in_flight_seqs"] == 0
            and m["tessera:server_queued_seqs"] == 0 and m["tessera:server_queued_prompt_tokens"] == 0)


def load_args(base_url: str, **overrides) -> list[str]:
    """argv for tessera.bench.load.main."""
    argv = ["--base-url", base_url]
    for key, value in overrides.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


# ---- the two scenarios, shared by the CI tests (small) and full_run.py (full size) ------------------


def run_load_scenario(model_dir: Path, *, clients: int, duration: float, disconnect_fraction: float = 0.2,
                      max_tokens: int = 16, warmup_s: float = 3.0, server_flags: tuple[str, ...] = ()) -> dict:
    """Many streaming clients, some hanging up; then the server must be idle with its memory back.

    Returns the load summary plus `idle_metrics`, `rss_before_kib` (after a warm-up), `rss_after_kib`
    (once idle) and `rss_peak_kib` (during the load).
    """
    from tessera.bench import load

    with ServerProcess(model_dir, *server_flags) as srv:
        # Warm-up at the same concurrency: first-use allocations (torch buffers, the allocator's
        # arenas, connection objects) are not a leak, and the baseline must include them.
        load.main(load_args(srv.base_url, clients=clients, duration=warmup_s, max_tokens=max_tokens,
                            disconnect_fraction=disconnect_fraction, seed=99))
        srv.wait_idle()
        rss_before = srv.rss_kib()
        srv.sample_rss_peak()
        summary = load.main(load_args(srv.base_url, clients=clients, duration=duration, max_tokens=max_tokens,
                                      disconnect_fraction=disconnect_fraction))
        peak = srv.stop_sampling()
        summary["idle_metrics"] = srv.wait_idle()
        summary["rss_before_kib"], summary["rss_after_kib"], summary["rss_peak_kib"] = rss_before, srv.rss_kib(), peak
        summary["healthy_after"] = httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
        summary["exit_code"] = srv.stop()
        summary["server_log_tail"] = "".join(srv.log[-60:])
    return summary


def run_overload_scenario(model_dir: Path, *, capacity_s: float, overload_s: float, factor: float = 5.0,
                          max_num_seqs: int = 4, max_waiting: int = 4, max_tokens: int = 64) -> dict:
    """Measure the server's capacity (req/s) with a closed loop at its admission limit, then offer
    `factor` times that as Poisson arrivals. Returns both summaries and the memory figures."""
    from tessera.bench import load

    flags = ("--max-num-seqs", str(max_num_seqs), "--max-waiting-requests", str(max_waiting))
    with ServerProcess(model_dir, *flags) as srv:
        capacity = load.main(load_args(srv.base_url, clients=max_num_seqs + max_waiting, duration=capacity_s,
                                       max_tokens=max_tokens, disconnect_fraction=0, endpoint="completions"))
        srv.wait_idle()
        rss_before = srv.rss_kib()
        rate = factor * capacity["completed_per_s"]
        srv.sample_rss_peak()
        overload = load.main(load_args(srv.base_url, rate=f"{rate:.3f}", max_in_flight=512, duration=overload_s,
                                       max_tokens=max_tokens, disconnect_fraction=0, endpoint="completions"))
        peak = srv.stop_sampling()
        idle = srv.wait_idle()
        rss_after = srv.rss_kib()
        exit_code = srv.stop()
        log_tail = "".join(srv.log[-60:])
    return {"capacity": capacity, "overload": overload, "offered_rate": rate, "idle_metrics": idle,
            "rss_before_kib": rss_before, "rss_peak_kib": peak, "rss_after_kib": rss_after, "exit_code": exit_code,
            "server_log_tail": log_tail}
