"""Trace loaders for the public formats: detection, what each record becomes, unknown fields
(one warning, ignored), and malformed lines (an error naming the line, or skipped and reported
with --skip-bad-lines)."""

from __future__ import annotations

import json
import logging

import pytest

from tessera.advisor.formats import MOONCAKE_BLOCK_TOKENS, TraceFormatError, detect_format, load_trace
from tessera.advisor.trace import read_trace

B = MOONCAKE_BLOCK_TOKENS


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


# ---- Mooncake ---------------------------------------------------------------------------------


def mooncake_rows():
    return [
        {"timestamp": 0, "input_length": 2 * B + 100, "output_length": 12, "hash_ids": [1, 2, 3]},
        {"timestamp": 250, "input_length": 2 * B, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": B + 10, "output_length": 7, "hash_ids": [1, 9], "note": "x"},
        {"timestamp": 2000, "input_length": 300, "output_length": 3, "hash_ids": []},
    ]


def test_mooncake_requests_sharing_a_hash_id_share_its_512_tokens(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    write_jsonl(path, mooncake_rows())
    assert detect_format(path) == "mooncake"
    a, b, c, d = load_trace(path, vocab_size=5000)
    assert [r.arrival_time for r in (a, b, c, d)] == [0.0, 0.25, 1.5, 2.0]  # ms -> s
    assert [len(r.prompt_token_ids) for r in (a, b, c, d)] == [2 * B + 100, 2 * B, B + 10, 300]
    assert [r.max_tokens for r in (a, b, c, d)] == [12, 5, 7, 3]
    assert a.sampling_params().ignore_eos and a.sampling_params().temperature == 0.0
    assert a.prompt_token_ids[: 2 * B] == b.prompt_token_ids  # hash ids 1, 2
    assert c.prompt_token_ids[:B] == a.prompt_token_ids[:B]  # hash id 1 ...
    assert c.prompt_token_ids[B:] != a.prompt_token_ids[B : B + 10]  # ... then 9, not 2
    assert a.prompt_token_ids[:B] != a.prompt_token_ids[B : 2 * B]  # distinct ids, distinct blocks
    assert all(100 <= t < 4999 for t in a.prompt_token_ids)


def test_mooncake_prefix_structure_reaches_the_prefix_profile(tmp_path):
    """Replayed through KVCacheManager's hashing, the shared blocks are hits: b's whole prompt
    but its last (partial-compute) block, and c's first 512 tokens."""
    from tessera.advisor.profile import prefix_profile

    path = tmp_path / "mooncake.jsonl"
    write_jsonl(path, mooncake_rows())
    trace = load_trace(path, vocab_size=5000)
    prof = prefix_profile([r.prompt_token_ids for r in trace], [None] * 4, block_size=16)
    assert prof.cached_tokens == [0, 2 * B - 16, B, 0]


def test_unknown_fields_are_warned_once_and_ignored(tmp_path, caplog):
    path = tmp_path / "mooncake.jsonl"
    rows = mooncake_rows()
    rows[0]["user"] = rows[1]["user"] = "u1"
    write_jsonl(path, rows)
    with caplog.at_level(logging.WARNING, logger="tessera.advisor"):
        assert len(load_trace(path)) == 4
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "note, user" in warnings[0]


@pytest.mark.parametrize("row, message", [
    ('{"timestamp": 0, "input_length": 10', "line 2|:2: not JSON"),
    ({"timestamp": 0, "output_length": 3, "hash_ids": []}, ":2: missing field 'input_length'"),
    ({"timestamp": -5, "input_length": 10, "output_length": 3}, ":2: timestamp .* must be >= 0"),
    ({"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1, 2]}, ":2: 2 hash_ids .* do not fit"),
    ({"timestamp": 0, "input_length": "ten", "output_length": 3}, ":2: input_length must be a number"),
])
def test_malformed_mooncake_lines_name_the_line(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [mooncake_rows()[0], row, mooncake_rows()[1]])
    with pytest.raises(TraceFormatError, match=message):
        load_trace(path, "mooncake")


def test_skip_bad_lines_skips_and_reports_them(tmp_path, caplog):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [mooncake_rows()[0], "not json", {"timestamp": 1, "input_length": 0, "output_length": 1},
                       mooncake_rows()[1]])
    with caplog.at_level(logging.WARNING, logger="tessera.advisor"):
        trace = load_trace(path, "mooncake", skip_bad_lines=True)
    assert [r.max_tokens for r in trace] == [12, 5]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "skipped 2 bad line(s)" in warning and "line 2 (" in warning and ", 3 (input_length" in warning


# ---- Azure and BurstGPT CSV ------------------------------------------------------------------


def test_azure_csv(tmp_path):
    path = tmp_path / "azure_conv.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:47.1805900,396,109\n"
                    "2023-11-16 18:16:46.0000000,12,1\n")
    assert detect_format(path) == "azure"
    trace = load_trace(path, vocab_size=1000)
    assert [r.arrival_time for r in trace] == pytest.approx([0.0, 0.5, 59.31941])
    assert [len(r.prompt_token_ids) for r in trace] == [374, 396, 12]
    assert [r.max_tokens for r in trace] == [44, 109, 1]
    assert trace[0].prompt_token_ids[:20] != trace[1].prompt_token_ids[:20]  # the trace records nothing shared


def test_azure_bad_row_names_its_line(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
                    "2023-11-16 18:15:47.18,396\n")
    with pytest.raises(TraceFormatError, match=r"azure.csv:3: expected 3 columns"):
        load_trace(path)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,374,44\n")
    with pytest.raises(TraceFormatError, match=r"azure.csv:2: timestamp 'yesterday' is neither"):
        load_trace(path)


def test_burstgpt_csv_leaves_out_failed_requests_with_a_warning(tmp_path, caplog):
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n"
                    "45,ChatGPT,1087,0,1087,Conversation log\n"
                    "7.5,GPT-4,200,30,230,API log\n")
    assert detect_format(path) == "burstgpt"
    with caplog.at_level(logging.WARNING, logger="tessera.advisor"):
        trace = load_trace(path)
    assert [(r.arrival_time, len(r.prompt_token_ids), r.max_tokens) for r in trace] == [(0.0, 472, 18),
                                                                                      (2.5, 200, 30)]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "left out 1 request(s) with 0" in messages and "Log Type, Model, Total tokens" in messages


def test_an_unknown_csv_header_names_the_formats(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceFormatError, match="--trace-format"):
        load_trace(path)


# ---- ShareGPT -------------------------------------------------------------------------------------


def test_sharegpt_turns_become_chat_requests_of_the_conversation_so_far(tmp_path):
    convs = [
        {"id": "c1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"},
                                       {"from": "human", "value": "and?"}, {"from": "gpt", "value": "more"}]},
        {"id": "c2", "conversations": [{"from": "system", "value": "be brief"},
                                       {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs, indent=1))
    assert detect_format(path) == "sharegpt"
    trace = load_trace(path, rate=2.0)
    by_id = {r.id: r for r in trace}
    assert by_id["c1-0"].messages == [{"role": "user", "content": "hi"}] and by_id["c1-0"].output == "hello there"
    assert by_id["c1-1"].messages[-1] == {"role": "user", "content": "and?"} and len(by_id["c1-1"].messages) == 3
    assert by_id["c1-1"].arrival_time > by_id["c1-0"].arrival_time and by_id["c1-1"].session == "c1"
    assert by_id["c2-0"].messages[0]["role"] == "system" and by_id["c2-0"].output == "a"
    assert len(trace) == 3


def test_sharegpt_bad_conversation_names_its_line(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text('[\n {"id": "a", "conversations": [{"from": "human", "value": "x"}]},\n'
                    ' {"id": "b", "conversations": [{"from": "robot", "value": "x"}]}\n]\n')
    with pytest.raises(TraceFormatError, match=r"sharegpt.json:3: a turn needs 'from'"):
        load_trace(path)
    assert [r.id for r in load_trace(path, skip_bad_lines=True)] == ["a-0"]


# ---- Tessera JSONL from other tools ---------------------------------------------------------------


def test_tessera_lines_take_timestamp_as_arrival_and_ignore_extra_fields(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [{"timestamp": 10.0, "prompt": "a", "max_tokens": 3, "user_id": 7},
                       {"timestamp": 12.5, "prompt": "b", "max_tokens": 3, "temperature": 0.5, "tenant": "x"},
                       {"arrival_time": 0.0, "timestamp": "2023-01-01T00:00:00", "prompt": "c"}])
    with caplog.at_level(logging.WARNING, logger="tessera.advisor"):
        trace = read_trace(path)
    assert [(r.prompt, r.arrival_time) for r in trace] == [("c", 0.0), ("a", 10.0), ("b", 12.5)]
    assert trace[2].sampling == {"temperature": 0.5}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "tenant, user_id" in warning


# ---- the CLI on the shipped Mooncake-style trace -------------------------------------------------


def test_tessera_profile_reads_the_shipped_mooncake_trace(tiny_model_factory, tmp_path, monkeypatch):
    """Its prefix hit rate is what its hash ids say: each request reuses the 512-token blocks of
    the longest hash-id prefix an earlier request held. A bad line stops the CLI with its line
    number, or is skipped with --skip-bad-lines."""
    from pathlib import Path

    from tessera.cli import main

    model = tiny_model_factory(max_position_embeddings=4096)
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    shipped = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "mooncake_style.jsonl"
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    def common_blocks(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    hits, seen = 0, []
    for r in rows:
        hits += B * max((common_blocks(r["hash_ids"], s) for s in seen), default=0)
        seen.append(r["hash_ids"][:-1])  # the last block is partly filled: never shared
    expected = hits / sum(r["input_length"] for r in rows)
    common = ["--model", str(model), "--dtype", "float32", "--num-threads", "1", "--quant-candidates", "none"]
    assert main(["profile", str(shipped), "-o", str(tmp_path / "p.json"), *common]) == 0
    prof = json.loads((tmp_path / "p.json").read_text())
    assert prof["num_requests"] == len(rows) and prof["prefix"]["hit_rate"] == pytest.approx(expected)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(shipped.read_text() + '{"timestamp": 1, "input_length": 9}\n')
    with pytest.raises(SystemExit, match=rf"bad.jsonl:{len(rows) + 1}: missing field 'output_length'"):
        main(["profile", str(bad), "-o", str(tmp_path / "p2.json"), *common])
    assert main(["profile", str(bad), "--skip-bad-lines", "-o", str(tmp_path / "p2.json"), *common]) == 0
