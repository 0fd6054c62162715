"""`tessera bench throughput|latency` on the tiny model: every generated token is accounted for,
the figures follow from the recorded timings by their definitions, JSON and PNG are written, and
the ShareGPT-shaped dataset gives the prompts and reply lengths the tokenizer says."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tessera.cli import main

FLAGS = ["--dtype", "float32", "--num-threads", "1", "--max-model-len", "128"]


def test_throughput_counts_every_token_and_writes_json_and_plot(tiny_model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "thr.json", tmp_path / "thr.png"
    assert main(["bench", "throughput", "--model", str(tiny_model_dir), *FLAGS, "--num-prompts", "6",
                 "--input-len", "12", "--output-len", "5", "--output-json", str(out), "--plot", str(png)]) == 0
    s = json.loads(out.read_text())
    assert (s["num_requests"], s["prompt_tokens"], s["output_tokens"]) == (6, 72, 30)
    assert sum(step["tokens"] for step in s["steps"]) == 30  # the per-step timeline saw every token
    assert s["requests_per_second"] == pytest.approx(6 / s["elapsed_time"])
    assert s["output_tokens_per_second"] == pytest.approx(30 / s["elapsed_time"])
    assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"] <= s["elapsed_time"] * 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latency_iterations_and_gaps(tiny_model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "lat.json", tmp_path / "lat.png"
    assert main(["bench", "latency", "--model", str(tiny_model_dir), *FLAGS, "--batch-size", "2", "--input-len", "8",
                 "--output-len", "6", "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out),
                 "--plot", str(png)]) == 0
    s = json.loads(out.read_text())
    lat = s["latencies"]
    assert len(lat) == 3 and s["avg_latency"] == pytest.approx(np.mean(lat))
    for p in (10, 50, 90, 99):
        assert s["percentiles"][str(p)] == pytest.approx(np.percentile(lat, p))
    assert s["latency_ms"]["p99"] == pytest.approx(np.percentile(lat, 99) * 1000)
    assert png.stat().st_size > 1000


def test_input_too_long_for_the_context_names_the_flag(tiny_model_dir):
    with pytest.raises(SystemExit, match="--max-model-len"):
        main(["bench", "latency", "--model", str(tiny_model_dir), *FLAGS, "--input-len", "100", "--output-len", "50"])


def test_sharegpt_prompts_and_reply_lengths(tiny_model_dir, tmp_path):
    import argparse

    from tokenizers import Tokenizer

    from tessera.bench.datasets import sample_requests

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    convs = [{"conversations": [{"from": "human", "value": f"question number {i} about paged attention"},
                                {"from": "gpt", "value": "an answer " * (i + 2)}]} for i in range(5)]
    convs.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})  # too short
    convs.append({"messages": [{"role": "user", "content": "one more question in the other shape"},
                               {"role": "assistant", "content": "and its answer, long enough"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    args = argparse.Namespace(dataset_name="sharegpt", dataset_path=str(path), num_prompts=100, output_len=None,
                              input_len=0, seed=0)
    reqs = sample_requests(args, encode, vocab_size=tok.get_vocab_size(), max_model_len=128)
    expected = {tuple(encode(t[0]["value" if "value" in t[0] else "content"])):
                len(encode(t[1]["value" if "value" in t[1] else "content"]))
                for c in convs for t in [c.get("conversations") or c["messages"]]}
    expected = {k: v for k, v in expected.items() if len(k) >= 4 and v >= 4}
    assert {tuple(r.prompt_token_ids): r.output_len for r in reqs} == expected
    with pytest.raises(SystemExit, match="--dataset-path"):
        sample_requests(argparse.Namespace(**{**vars(args), "dataset_path": None}), encode, 1000, 128)
