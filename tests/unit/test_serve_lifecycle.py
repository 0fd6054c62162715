"""`tessera serve` as a process: start-up checks, graceful drain on SIGTERM, clean exit.

The server runs as a real subprocess (tests.gated_serve: the `tessera` command with a gate on the
engine's steps), so signals, sockets and exit codes are the real ones; the gate fixes how many
tokens a request gets before the signal, so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.load.harness import MODEL, ServerProcess


class GatedServer(ServerProcess):
    """ServerProcess whose engine waits before each step past the number written to `gate`."""

    def __init__(self, model_dir: Path, gate: Path, *flags: str) -> None:
        super().__init__(model_dir, "--log-level", "info", *flags)
        self.gate = gate
        self.cmd[1:3] = ["-m", "tests.gated_serve"]
        os.environ["TESSERA_TEST_GATE"] = str(gate)

    def allow_steps(self, n: int) -> None:
        tmp = self.gate.with_suffix(".tmp")
        tmp.write_text(str(n))
        os.replace(tmp, self.gate)  # atomic: the engine never reads half a number

    def open_gate(self) -> None:
        self.gate.unlink(missing_ok=True)

    def wait_for_log(self, fragment: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(fragment in line for line in self.log):
            assert time.monotonic() < deadline and self.proc.poll() is None, \
                f"no log line with {fragment!r}:\n" + "".join(self.log[-30:])
            time.sleep(0.02)

    def wait_exit(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)


def _sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def _assert_clean_log(log: list[str]) -> None:
    text = "".join(log)
    for bad in ("Traceback", "ERROR", "CancelledError", "Cancel ", "after the server stopped"):
        assert bad not in text, f"{bad!r} in the server log:\n{text[-3000:]}"


def test_sigterm_ends_a_running_stream_with_abort_usage_and_done_and_exits_0(tiny_model_dir, tmp_path):
    srv = GatedServer(tiny_model_dir, tmp_path / "gate", "--shutdown-timeout", "0.5")
    with srv:
        srv.allow_steps(4)  # the prefill (first token) and three decode steps, then the engine waits
        body = {"model": MODEL, "prompt": "the weather today", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = _sse_events(r)
            first = json.loads(next(events))
            assert first["choices"][0]["finish_reason"] is None
            srv.proc.send_signal(signal.SIGTERM)
            rest = list(events)
        srv.open_gate()
        rc = srv.wait_exit()
    assert rest[-1] == "[DONE]"
    chunks = [first] + [json.loads(e) for e in rest[:-1]]
    assert all("error" not in c for c in chunks), chunks
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "abort" and reasons.count("abort") == 1 and set(reasons[:-1]) <= {None}
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert rc == 0
    _assert_clean_log(srv.log)
    # "serving ..." only once uvicorn had the app up on the bound socket.
    serving = next(i for i, line in enumerate(srv.log) if "serving 'tiny' on http://127.0.0.1:" in line)
    assert serving > next(i for i, line in enumerate(srv.log) if "Application startup complete" in line)


def test_sigterm_lets_an_in_flight_request_finish_within_the_shutdown_timeout(tiny_model_dir, tmp_path):
    srv = GatedServer(tiny_model_dir, tmp_path / "gate", "--shutdown-timeout", "60")
    with srv:
        srv.allow_steps(2)
        body = {"model": MODEL, "prompt": "the weather today", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        result: dict = {}
        sender = threading.Thread(target=lambda: result.setdefault(
            "r", httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)))
        sender.start()
        deadline = time.monotonic() + 30
        while srv.metrics()["tessera:num_requests_running"] != 1:  # held by the gate after 2 tokens
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        srv.wait_for_log("waiting up to 60s (--shutdown-timeout) for 1 request(s) in flight")
        # Draining: the listener is closed, so a new client cannot even connect.
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.base_url + "/health", timeout=5)
        srv.open_gate()  # the engine may finish the request now, well inside the 60 s
        sender.join(60)
        rc = srv.wait_exit()
    r = result["r"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 8
    assert rc == 0
    _assert_clean_log(srv.log)


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TESSERA_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_a_busy_port_is_reported_in_one_line_before_the_model_loads(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _run_cli("serve", str(tiny_model_dir), "--port", str(port), "--dtype", "float32")
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"tessera: error: port {port} on 127.0.0.1 is already in use (another server?): stop it, "
                      f"or pick another --port"], r.stderr
    assert "Traceback" not in r.stderr
    # Checked before the model loaded, and nothing claimed to be serving.
    assert "loaded " not in r.stderr and "serving" not in r.stderr
