"""The default model (SmolLM2-135M-Instruct, GGUF) against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.attention.metadata import single_sequence_metadata
from tests.reference import hf_greedy

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Paged attention stores the key-value cache in fixed-size blocks so that",
    "Q: What is the capital of Japan?\nA:",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), dtype="float32", kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def hf_model(hf_default_model):
    return hf_default_model


def test_prompt_logits_match_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    ids = tok.encode(" ".join(PROMPTS))[:64]
    assert len(ids) == 64
    model = llm.engine.runner.model
    caches = model.allocate_kv_cache(num_blocks=6, block_size=16)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(64), caches, single_sequence_metadata(64))
        ours = model.compute_logits(hidden)
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_64_tokens_match_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)  # batched together through the engine
    for prompt, out in zip(PROMPTS, outs, strict=True):
        expected = hf_greedy(hf_model, tok.encode(prompt), 64)
        assert out.outputs[0].token_ids == expected, prompt


def test_chat_reply_is_sensible(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")
