"""`tessera bench serve` and `bench load` in vLLM's flag shape against a real server (the tiny
model): a ShareGPT-shaped dataset gives each request its reply's length, and --plot writes PNGs."""

from __future__ import annotations

import json

import httpx
import pytest

from tessera.server.app import create_app
from tests.unit.test_server import ServerThread, engine_config

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(create_app(engine_config(tiny_model_dir), served_model_name="tiny")) as srv:
        yield srv


def test_serve_bench_sharegpt_lengths_and_plot(server, tmp_path):
    from tessera.bench.serve import main

    replies = ["short reply here", "a somewhat longer reply with more words in it", "x y z w v u"]
    data = [{"conversations": [{"from": "human", "value": f"prompt {i} about the cache"},
                               {"from": "gpt", "value": r}]} for i, r in enumerate(replies)]
    path, png, out = tmp_path / "sg.json", tmp_path / "serve.png", tmp_path / "serve.json"
    path.write_text(json.dumps(data))
    summary = main(["--base-url", server.base_url, "--dataset-name", "sharegpt", "--dataset-path", str(path),
                    "--num-prompts", "3", "--request-rate", "50", "--max-duration", "60", "--output-json", str(out),
                    "--plot", str(png)])
    assert summary["completed"] == 3 and summary["failed"] == 0

    def ntokens(text: str) -> int:
        r = httpx.post(server.base_url + "/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False})
        return len(r.json()["tokens"])

    generated = summary["output_token_throughput"] * summary["duration_s"]
    assert generated == pytest.approx(sum(ntokens(r) for r in replies))
    assert json.loads(out.read_text())["completed"] == 3
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_load_takes_vllm_flag_names_and_plots(server, tmp_path):
    from tessera.bench import load

    png, out = tmp_path / "load.png", tmp_path / "load.json"
    s = load.main(["--base-url", server.base_url, "--request-rate", "20", "--num-prompts", "6", "--duration", "5",
                   "--output-len", "3", "--disconnect-fraction", "0", "--output-json", str(out), "--plot", str(png)])
    assert s["sent"] == 6 and s["completed"] == 6 and s["config"]["max_tokens"] == 3
    assert json.loads(out.read_text())["completed"] == 6
    assert png.read_bytes()[:4] == b"\x89PNG"
