"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): fetched and cached, read exactly as
transformers' GGUF loader reads it, and tokenized with its own vocabulary and chat template.

Marked integration (through the default_model_path fixture): about a minute in all.
"""

from __future__ import annotations

import random

import pytest
import torch

from tessera.config import DEFAULT_MODEL
from tessera.model import download
from tessera.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tessera.model.weights import expected_weight_names, load_model_files

transformers = pytest.importorskip("transformers")


def test_default_model_is_cached(default_model_path, monkeypatch):
    assert default_model_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_model_path.read_bytes()[:4] == b"GGUF"

    def no_download(*args, **kwargs):
        raise AssertionError("the cached model was downloaded again")

    monkeypatch.setattr(download.subprocess, "run", no_download)
    assert download.resolve_model_path(DEFAULT_MODEL) == default_model_path


def test_default_gguf_matches_transformers(default_model_path, hf_default_model):
    files = load_model_files(default_model_path)
    ref = hf_default_model
    c, r = files.config, ref.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        "llama", r.vocab_size, r.hidden_size, r.intermediate_size, r.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (r.num_attention_heads, r.num_key_value_heads, r.head_dim)
    assert c.rms_norm_eps == pytest.approx(r.rms_norm_eps, rel=1e-6)
    assert c.rope_theta == r.rope_parameters["rope_theta"] and c.rope_scaling is None
    assert c.max_position_embeddings == r.max_position_embeddings
    assert c.tie_word_embeddings and r.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_ids) == (r.bos_token_id, (r.eos_token_id,))

    state = ref.state_dict()
    names = []
    for name, tensor in files.weights():  # every tensor, un-permuted q/k included, bit for bit
        names.append(name)
        torch.testing.assert_close(tensor.float(), state[name], rtol=0, atol=0, msg=name)
    assert sorted(names) == sorted(expected_weight_names(c)) == sorted(set(state) - {"lm_head.weight"})


@pytest.fixture(scope="module")
def tokenizer(default_model_path) -> Tokenizer:
    return Tokenizer(default_model_path, load_model_files(default_model_path).config)


def test_default_tokenizer(tokenizer):
    assert tokenizer.eos_token_ids == {2} and tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == 49152
    assert tokenizer.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    assert tokenizer.decode([1, 2]) == ""
    text = "Hello, world! Grüße aus Zürich: 世界 🙂\n  def f(x): return x**2"
    assert tokenizer.decode(tokenizer.encode(text)) == text

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2 and tokenizer.decode(ids, skip_special_tokens=False) == prompt


def test_default_detokenizer_streams(tokenizer):
    rng = random.Random(0)
    text = "Streaming: naïve café, 日本語のテキスト, emoji 🧑‍🚀👍🏽, math ∑∫√."
    output = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say something:"), skip_special_tokens=True)
    deltas = [detok.append(t) for t in output]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    for _ in range(20):  # random ids from the whole vocabulary, specials included
        output = [rng.randrange(tokenizer.vocab_size) for _ in range(30)]
        detok = IncrementalDetokenizer(tokenizer, [rng.randrange(tokenizer.vocab_size)], skip_special_tokens=True)
        streamed = "".join(detok.append(t) for t in output) + detok.flush()
        assert streamed == tokenizer.decode(output)
