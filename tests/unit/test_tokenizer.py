"""Tokenizer and incremental detokenizer, against transformers' tokenizer and the raw
`tokenizers` object the tiny vocabulary was built from."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tessera.model.weights import load_model_files
from tests.tiny_model import build_tokenizer, write_gguf_from_hf_dir

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "the weather in Zürich",
    "  leading and trailing spaces  ",
    "multi-byte: 世界, emoji 🙂🚀, combining é, Ω≈ç√",
    "<|im_start|>user\nhi<|im_end|>\n",
    "line\nbreaks\tand\ttabs\r\n",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir, load_model_files(tiny_model_dir).config)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer, reference, text):
    raw = build_tokenizer()
    for add_special in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=add_special)
        assert ids == reference.encode(text, add_special_tokens=add_special)
        assert ids == raw.encode(text, add_special_tokens=add_special).ids
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(tokenizer, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüß dich 🙂"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGrüß dich 🙂<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tokenizer.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_no_chat_template_is_a_clear_error(tiny_model_dir, tmp_path):
    for f in tiny_model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_special_ids(tiny_model_dir, tokenizer, reference):
    im_end, endoftext = reference.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # the tokenizer's eos plus generation_config.json's list
    assert tokenizer.eos_token_ids == {im_end, endoftext}
    assert Tokenizer(tiny_model_dir).eos_token_ids == {im_end}
    assert tokenizer.vocab_size == len(reference) == build_tokenizer().get_vocab_size()
    assert tokenizer.bos_token_id == reference.bos_token_id


@pytest.mark.parametrize("load", ["converted", "from cache"])
def test_gguf_tokenizer_matches_hf_folder(tiny_model_dir, tokenizer, tmp_path, monkeypatch, load):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    path = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "tiny.gguf")
    from_gguf = Tokenizer(path, load_model_files(path).config)
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1  # the conversion was cached
    if load == "from cache":
        from_gguf = Tokenizer(path, load_model_files(path).config)
    for text in TEXTS:
        assert from_gguf.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
        ids = tokenizer.encode(text)
        assert from_gguf.decode(ids) == tokenizer.decode(ids)
    messages = [{"role": "user", "content": "hi"}]
    assert from_gguf.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert from_gguf.eos_token_ids == {tokenizer.hf.convert_tokens_to_ids("<|im_end|>")}


def stream(tokenizer, prompt, output, chunks, skip_special_tokens) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas, i = [], 0
    for size in chunks:
        if i >= len(output):
            break
        deltas.append(detok.append(output[i : i + size] if size > 1 else output[i]))
        i += size
    if i < len(output):
        deltas.append(detok.append(output[i:]))
    return deltas, detok


VOCAB = 267  # 256 bytes + 8 merges + 3 specials


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    output=st.lists(st.integers(0, VOCAB - 1), max_size=40),
    chunks=st.lists(st.integers(1, 3), max_size=40),
    skip=st.booleans(),
)
def test_detokenizer_random_ids_concatenate_to_decode(tokenizer, prompt, output, chunks, skip):
    """Random byte tokens make incomplete and invalid UTF-8: deltas hold back a trailing U+FFFD,
    and deltas plus flush() always equal decoding the output at once."""
    deltas, detok = stream(tokenizer, prompt, output, chunks, skip)
    assert all(not d.endswith("\ufffd") for d in deltas)
    assert "".join(deltas) + detok.flush() == tokenizer.decode(output, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prefix=st.text(max_size=10),
    text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40),
    chunks=st.lists(st.integers(1, 3), max_size=60),
)
def test_detokenizer_streams_valid_text_exactly(tokenizer, prefix, text, chunks):
    """Multi-byte characters split over byte tokens come out whole, never as U+FFFD."""
    prompt = tokenizer.encode(prefix, add_special_tokens=False)
    output = tokenizer.encode(text, add_special_tokens=False)
    deltas, detok = stream(tokenizer, prompt, output, chunks, skip_special_tokens=False)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.flush() == ""
    assert "".join(deltas) == detok.output_text == text


def test_detokenizer_keeps_a_small_window(tokenizer):
    text = "héllo wörld 世界 🙂 " * 50
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"), skip_special_tokens=True)
    longest = 0
    for token in tokenizer.encode(text, add_special_tokens=False):
        detok.append(token)
        longest = max(longest, len(detok.token_ids))
    assert detok.output_text == text
    assert longest <= IncrementalDetokenizer.CONTEXT_TOKENS + 4  # 4 = longest UTF-8 character
