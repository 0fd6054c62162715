"""The `tessera` command line as a new user meets it: help, version, vLLM's flag names, one-line
errors with exit codes, the flag table's single source, streaming `generate`, and the Makefile."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from tessera import __version__
from tessera.cli import build_parser, main
from tessera.config import DEFAULT_MODEL, EngineConfig, ModelConfig
from tessera.engine_args import ENGINE_FLAGS, NOT_FLAGS

ROOT = Path(__file__).resolve().parents[2]


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    _, subs = build_parser()
    return subs


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own exits (--help, --version, bad syntax)
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---- help and version -----------------------------------------------------------------------------


def test_version(capsys):
    rc, out, _ = _run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"tessera {__version__}"


@pytest.mark.parametrize("name", ["serve", "generate", "quality", "profile", "advise", "bench load"])
def test_every_flag_has_a_sentence_and_shows_its_default(name, capsys):
    parser = _all_parsers()[name]
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction) or action.help is argparse.SUPPRESS:
            continue
        assert action.help and len(action.help.strip()) > 10, f"{name} {action.option_strings}: no help"
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.help is not argparse.SUPPRESS \
                and not isinstance(action, argparse._HelpAction):
            shown = formatter._get_help_string(action) % vars(action)  # what --help prints for it
            assert "default" in shown, f"{name} {action.option_strings}: no default shown"


def test_bench_serve_help_names_its_own_command(capsys):
    rc, out, _ = _run(["bench", "serve", "--help"], capsys)
    assert rc == 0 and out.startswith("usage: tessera bench serve ")


def test_every_subcommand_takes_the_model_as_model_flag():
    for name in ("serve", "generate", "quality", "profile"):
        positional = {"generate": ["hi"], "profile": ["trace.jsonl"]}.get(name, [])
        args = _all_parsers()[name].parse_args(["--model", "/m", *positional])
        model = getattr(args, "model_flag", None) or args.model
        assert model == "/m", name
    serve = _all_parsers()["serve"]
    assert serve.parse_args(["/m"]).model == "/m"


# ---- one source per flag ----------------------------------------------------------------------------


def test_every_engine_config_field_is_a_flag_whose_default_is_the_fields():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {f.field for f in ENGINE_FLAGS} == fields - NOT_FLAGS
    from tessera.engine_args import engine_config

    args = _all_parsers()["serve"].parse_args([])
    assert engine_config("m", args) == EngineConfig(model="m")


# ---- vLLM's names -------------------------------------------------------------------------------------


def test_vllm_flags_map_onto_tessera_settings(tmp_path):
    from tessera.server.args import engine_config_from_args, serve_model

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = _all_parsers()["serve"].parse_args([
        "--model", "/models/x", "--tokenizer", "/models/tok", "--chat-template", str(template),
        "--gpu-memory-utilization", "0.5", "--max-logprobs", "5", "--disable-log-requests",
        "--uvicorn-log-level", "warning", "--trust-remote-code", "--device", "cpu", "--enforce-eager",
        "--tensor-parallel-size", "1", "--max-model-len", "4096", "--allow-long-context"])
    config = engine_config_from_args(args)
    assert serve_model(args) == config.model == "/models/x"
    assert (config.tokenizer, config.chat_template, config.kv_cache_memory_fraction, config.max_logprobs) == \
        ("/models/tok", str(template), 0.5, 5)
    assert config.enforce_eager and config.allow_long_context and config.device == "cpu"
    assert args.disable_log_requests and args.uvicorn_log_level == "warning"


def test_max_model_len_beyond_the_trained_context_needs_allow_long_context():
    mc = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8, intermediate_size=16,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=8192)
    assert EngineConfig().resolve_max_model_len(mc) == 8192
    assert EngineConfig(max_model_len=4096).resolve_max_model_len(mc) == 4096
    with pytest.raises(ValueError, match="--max-model-len 100000 is beyond the model's trained context of 8192 "
                                         "tokens.*--allow-long-context"):
        EngineConfig(max_model_len=100000).resolve_max_model_len(mc)
    assert EngineConfig(max_model_len=100000, allow_long_context=True).resolve_max_model_len(mc) == 100000


def test_chat_template_and_max_logprobs_reach_the_engine(tiny_model_dir):
    from tessera.engine.engine import LLMEngine
    from tessera.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=64, num_threads=1,
                                    chat_template="<{% for m in messages %}{{ m.content }}{% endfor %}>",
                                    max_logprobs=2))
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<hi>"
    with pytest.raises(ValueError, match=r"logprobs 3 is more than this server's limit of 2 \(--max-logprobs\)"):
        engine.add_request("r", [1, 2], SamplingParams(max_tokens=1, logprobs=3))
    engine.add_request("ok", [1, 2], SamplingParams(max_tokens=1, logprobs=2))


# ---- one-line errors and exit codes ---------------------------------------------------------------


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_tensor_parallel_is_a_usage_error_naming_data_parallel(capsys):
    rc, _, err = _run(["serve", "--tensor-parallel-size", "2"], capsys)
    assert rc == 2
    assert _error_lines(err) == ["tessera: error: --tensor-parallel-size 2: Tessera has no tensor parallelism; to "
                                 "use 2 devices or processes run replicas with `tessera serve --data-parallel 2`, "
                                 "or drop the flag"]


def test_a_bad_setting_is_a_usage_error_in_one_line(capsys):
    rc, _, err = _run(["generate", "hi", "--block-size", "3"], capsys)
    assert rc == 2 and _error_lines(err) == ["tessera: error: --block-size must be a positive power of two, got 3"]


@pytest.mark.parametrize("command", [["serve", "meta-llama/Llama-3.2-1B"], ["generate", "hi", "--model",
                                                                            "meta-llama/Llama-3.2-1B"]])
def test_a_hub_id_says_hub_downloads_are_unsupported_and_what_to_do(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no such local folder
    rc, _, err = _run(command, capsys)
    assert rc == 1
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("tessera: error: model 'meta-llama/Llama-3.2-1B' looks like a "
                                                   "Hugging Face hub id, and Tessera does not download from the hub")
    assert "huggingface-cli download meta-llama/Llama-3.2-1B --local-dir ./Llama-3.2-1B" in lines[0]
    assert "Traceback" not in err


def test_a_missing_model_path_is_one_line_and_debug_shows_the_traceback(capsys, tmp_path):
    missing = str(tmp_path / "no-such-model")
    rc, _, err = _run(["generate", "hi", "--model", missing], capsys)
    assert rc == 1 and len(_error_lines(err)) == 1 and f"model {missing!r} not found" in err
    rc, _, err = _run(["generate", "hi", "--model", missing, "--debug"], capsys)
    assert rc == 1 and "Traceback (most recent call last)" in err and f"model {missing!r} not found" in err


def test_an_unsupported_architecture_is_one_line(capsys, tiny_model_factory, tmp_path):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_factory(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    config["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(config))
    rc, _, err = _run(["generate", "hi", "--model", str(folder), "--dtype", "float32"], capsys)
    lines = [x for x in _error_lines(err) if not x[:4].isdigit()]  # log lines start with the date
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("tessera: error: ") and "Mamba" in lines[0], err
    assert "Traceback" not in err


# ---- generate streams; LLM() says what it is doing ------------------------------------------------------


def test_generate_prints_the_reply_as_it_is_generated(tiny_model_dir, capsys, monkeypatch):
    from tessera import LLM, SamplingParams

    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            writes.append("<flush>")

    monkeypatch.setattr(sys, "stdout", Recorder())
    rc = main(["generate", "the weather", "--raw", "--model", str(tiny_model_dir), "--dtype", "float32",
               "--max-tokens", "12", "--max-model-len", "64", "--num-threads", "1"])
    monkeypatch.undo()
    assert rc == 0
    pieces = [w for w in writes if w not in ("<flush>", "\n")]
    assert len(pieces) > 1 and writes.count("<flush>") >= len(pieces)  # flushed piece by piece
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, num_threads=1)
    reference = llm.generate("the weather", SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert "".join(pieces) == reference[0].outputs[0].text


def test_llm_logs_while_it_loads(tiny_model_dir, capsys, monkeypatch):
    import logging

    from tessera import LLM

    # As in a plain script: nothing configured logging (pytest's own handlers set aside).
    root, tessera_logger = logging.getLogger(), logging.getLogger("tessera")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(tessera_logger, "handlers", [])
    monkeypatch.setattr(tessera_logger, "level", logging.NOTSET)
    monkeypatch.setattr(root, "level", logging.WARNING)
    LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, num_threads=1)
    err = capsys.readouterr().err
    assert f"loading {tiny_model_dir}" in err and "loaded " in err


# ---- make ---------------------------------------------------------------------------------------------


def _make_dry_run(target: str, *extra: str) -> str:
    r = subprocess.run(["make", "-n", target, "VENV=/nonexistent-venv", *extra], capture_output=True, text=True,
                       cwd=ROOT, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_serve_installs_only_what_serving_needs_and_passes_flags():
    out = _make_dry_run("serve", 'ARGS=--port 9000')
    installs = [line for line in out.splitlines() if "pip install" in line]
    assert installs and not any("[dev]" in line or "dev]" in line for line in installs), installs
    assert any("torch==2.13.0" in line for line in installs)
    assert any(line.endswith("pip install -q -e .") for line in installs)
    assert "/nonexistent-venv/bin/tessera serve --port 9000" in out


def test_make_test_installs_the_dev_extra_and_ci_calls_it():
    out = _make_dry_run("test")
    assert any("pip install" in line and "'.[dev]'" in line for line in out.splitlines())
    assert "python -m pytest" in out
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_default_model_name_is_what_serve_uses_without_arguments():
    from tessera.server.args import serve_model

    assert serve_model(_all_parsers()["serve"].parse_args([])) == DEFAULT_MODEL
