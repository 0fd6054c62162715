"""Load and overload on the tiny model, through `tessera bench load` against a `tessera serve`
subprocess (scaled down for CI; tests/load/full_run.py runs the full-size figures).

- Load: 64 concurrent streaming clients for 15 s, 20% hanging up at random points. Every client
  that stayed gets a complete, well-formed stream (and the same greedy text for the same prompt);
  afterwards no KV block is in use, nothing runs, waits or is in flight, and the server's resident
  memory is within 10% of its level before the load.
- Overload: 5x the measured capacity, offered as Poisson arrivals against --max-num-seqs 4
  --max-waiting-requests 4: the excess gets 503 at once, every accepted request completes,
  throughput holds and memory stays bounded.
"""

from __future__ import annotations

import pytest

from tessera.bench.load import MalformedStream, check_stream
from tessera.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from tests.load.harness import is_idle, run_load_scenario, run_overload_scenario


def _completion_stream(texts: list[str], finish: str = "length", usage_tokens: int | None = None) -> list[str]:
    chunks = [CompletionResponse(id="cmpl-1", model="tiny", choices=[CompletionChoice(
        index=0, text=t, finish_reason=finish if i == len(texts) - 1 else None)]) for i, t in enumerate(texts)]
    n = len(texts) if usage_tokens is None else usage_tokens
    chunks.append(CompletionResponse(id="cmpl-1", model="tiny", choices=[],
                                     usage=UsageInfo(prompt_tokens=3, completion_tokens=n, total_tokens=3 + n)))
    return [f"data: {c.model_dump_json()}" for c in chunks] + ["data: [DONE]"]


def test_the_load_generator_accepts_only_complete_well_formed_streams():
    assert check_stream("completions", _completion_stream(["a", "b", "c"]), 3) == "abc"
    chat = [ChatCompletionChunk(id="c", model="tiny", choices=[ChatChunkChoice(index=0, delta=DeltaMessage(
        role="assistant", content=""))]), ChatCompletionChunk(id="c", model="tiny", choices=[ChatChunkChoice(
            index=0, delta=DeltaMessage(content="hi"), finish_reason="length")]),
        ChatCompletionChunk(id="c", model="tiny", choices=[], usage=UsageInfo(prompt_tokens=1, completion_tokens=1,
                                                                             total_tokens=2))]
    assert check_stream("chat", [f"data: {c.model_dump_json()}" for c in chat] + ["data: [DONE]"], 1) == "hi"
    good = _completion_stream(["a", "b"])
    bad_streams = {
        "no [DONE]": good[:-1],
        "cut mid-stream": good[:1],
        "an error chunk": good[:1] + ['data: {"error": {"message": "boom", "type": "x", "param": null, "code": null}}']
        + good[1:],
        "not SSE": good[:1] + ["event: ping"] + good[1:],
        "not JSON": good[:1] + ["data: {oops"] + good[1:],
        "finish_reason twice": _completion_stream(["a"])[:1] + good[1:],
        "finish_reason abort": _completion_stream(["a", "b"], finish="abort"),
        "wrong usage": _completion_stream(["a", "b"], usage_tokens=5),
    }
    for what, lines in bad_streams.items():
        with pytest.raises(MalformedStream):
            check_stream("completions", lines, 2)
            raise AssertionError(f"accepted a stream with {what}")


def test_64_streaming_clients_with_20_percent_disconnects(tiny_model_dir):
    s = run_load_scenario(tiny_model_dir, clients=64, duration=15, disconnect_fraction=0.2, warmup_s=3)
    print(f"\nload: served {s['completed']}, hung up {s['disconnected']}, errors {s['errors']}, "
          f"malformed {s['malformed']}, p99 {s['latency_ms']['p99']:.0f} ms; "
          f"RSS {s['rss_before_kib']} -> peak {s['rss_peak_kib']} -> {s['rss_after_kib']} KiB")
    assert s["errors"] == 0 and s["malformed"] == 0, s["error_messages"]
    assert s["inconsistent_prompts"] == 0
    assert s["rejected"] == 0
    assert s["completed"] >= 100 and s["disconnected"] >= 10
    assert is_idle(s["idle_metrics"]), {k: v for k, v in s["idle_metrics"].items() if "num_requests" in k or "server_" in k
                                        or "kv_cache_usage" in k}
    assert s["rss_after_kib"] <= 1.10 * s["rss_before_kib"], (s["rss_before_kib"], s["rss_after_kib"])
    assert s["healthy_after"] and s["exit_code"] == 0


def test_overload_at_5x_capacity_gets_fast_503s_and_completes_what_it_accepts(tiny_model_dir):
    r = run_overload_scenario(tiny_model_dir, capacity_s=4, overload_s=8)
    cap, over = r["capacity"], r["overload"]
    print(f"\noverload: capacity {cap['completed_per_s']:.1f}/s, offered {r['offered_rate']:.1f}/s "
          f"(sent {over['sent'] / over['duration_s']:.1f}/s); served {over['completed']}, rejected {over['rejected']}, "
          f"errors {over['errors']}; 503 p99 {over['rejection_latency_ms']['p99']:.1f} ms, served p99 "
          f"{over['latency_ms']['p99']:.0f} ms; RSS {r['rss_before_kib']} -> peak {r['rss_peak_kib']} KiB")
    assert cap["errors"] == 0 and cap["malformed"] == 0 and cap["completed"] > 0
    assert over["errors"] == 0 and over["malformed"] == 0, over["error_messages"]
    assert over["inconsistent_prompts"] == 0
    # The excess was refused, and everything accepted was served in full. How much was refused is
    # not asserted: the client shares the two cores, so the rate it really sends (here once 156/s of
    # the 401/s offered, and 677 refused against 760 served) moves with the machine.
    assert over["rejected"] > 0 and over["completed"] > 0
    assert over["completed"] + over["rejected"] == over["finished"] == over["sent"]
    # How fast the 503s came and how long the accepted ones waited are printed above, not asserted:
    # they are benchmark figures that a busy machine changes (test_hardening.py shows, with the
    # engine held, that a 503 never waits for an engine step). Its memory stayed put.
    assert r["rss_peak_kib"] <= 1.10 * r["rss_before_kib"]
    assert is_idle(r["idle_metrics"]) and r["exit_code"] == 0
    assert r["idle_metrics"]['tessera:requests_rejected_total{reason=waiting_requests}'] == over["rejected"]


if __name__ == "__main__":
    pytest.main([__file__, "-s", "-q"])
