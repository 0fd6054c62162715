"""What every engine runner shares: reading the workload compare.py wrote, the single-stream
timing rule, and writing the result. Standard library only: the runners live in different venvs
(vLLM's, llama.cpp's, Tessera's), so none of them can import Tessera or torch from here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def runner_args(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", required=True, help="JSON written by benchmarks/compare.py")
    ap.add_argument("--out", required=True, help="where this runner writes its result JSON")
    return ap


def load_workload(path: str) -> dict:
    """Keys: threads, output_len, throughput_prompts (list of token-id lists), single_prompts
    (distinct prompts, two per repetition), single_reps, and the model paths."""
    return json.loads(Path(path).read_text())


def single_stream(generate: Callable[[list[int], int], None], prompts: list[list[int]], output_len: int,
                  reps: int) -> dict:
    """TTFT and decode speed of one request alone, the same way for every engine.

    TTFT is the wall time of a request asking for 1 token (prefill + first token); decode speed is
    (output_len - 1) / (time of an output_len request - time of a 1-token request). Medians over
    `reps`; every request gets a prompt of its own, so no engine's prefix cache can help.
    """
    assert len(prompts) >= 2 * reps
    generate(prompts[-1][:16], 2)  # warm-up on a different, short prompt
    t_first, t_full = [], []
    for r in range(reps):
        t0 = time.perf_counter()
        generate(prompts[2 * r], 1)
        t_first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        generate(prompts[2 * r + 1], output_len)
        t_full.append(time.perf_counter() - t0)
    ttft, full = statistics.median(t_first), statistics.median(t_full)
    return {"ttft_s": ttft, "request_s": full, "decode_tok_s": (output_len - 1) / (full - ttft),
            "ttft_runs_s": t_first, "request_runs_s": t_full}


def parts(w: dict, offline: Callable[[], dict], single: Callable[[], dict]) -> dict:
    """Run the workload's parts (compare.py --parts: "throughput", "single" or both, so a slow
    engine's run fits in two short locked runs); {"throughput": ..., "single": ...} of those run."""
    chosen = w.get("parts", ["throughput", "single"])
    return {**({"throughput": offline()} if "throughput" in chosen else {}),
            **({"single": single()} if "single" in chosen else {})}


def throughput_result(seconds: float, prompts: list[list[int]], output_len: int) -> dict:
    n_in = sum(len(p) for p in prompts)
    n_out = len(prompts) * output_len
    return {"seconds": seconds, "requests": len(prompts), "req_s": len(prompts) / seconds,
            "in_tok_s": n_in / seconds, "out_tok_s": n_out / seconds,
            "total_tok_s": (n_in + n_out) / seconds}


def run_and_write(out: str, body: Callable[[], dict]) -> None:
    """Run the measurement; write its result, or the error that stopped it, to `out`."""
    result: dict = {"python": sys.version.split()[0], "platform": platform.platform(),
                    "pid": os.getpid()}
    try:
        result.update(body())
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the orchestrator records any failure as data
        result.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        Path(out).write_text(json.dumps(result, indent=2))
        raise
    Path(out).write_text(json.dumps(result, indent=2))


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
