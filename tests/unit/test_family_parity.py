"""Every model family against transformers on a tiny random checkpoint, through our own loader.

Each case builds the transformers model with random weights (norms and biases randomised too),
saves it with save_pretrained, loads the folder with `load_model_files` + `build_model` (so the
config mapping and the registry are under test as well) and compares float32 logits within 1e-4:
full prefill, chunked prefill over shuffled blocks in a NaN-filled cache, and greedy paged
decoding against transformers recomputing the whole context for every token. The windows are
smaller than the contexts, so local attention is exercised; where every layer is windowed, the
blocks that fell out of the window are swapped for block 0 (garbage), as the scheduler frees them.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.attention.metadata import single_sequence_metadata
from tessera.model.registry import build_model
from tessera.model.weights import load_model_files
from tests.unit.test_llama_parity import BLOCK, garbage_cache, shuffled_tables, step_metadata

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False)
CASES = {
    "mistral_window": (transformers.MistralConfig, dict(num_key_value_heads=2, head_dim=16, sliding_window=6)),
    "qwen2_bias": (transformers.Qwen2Config, dict(num_key_value_heads=2)),
    "qwen3_qk_norm": (transformers.Qwen3Config, dict(num_key_value_heads=2, head_dim=24)),
    "phi3_fused": (transformers.Phi3Config, dict(num_key_value_heads=2)),
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_key_value_heads=1, head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def make_hf_model(case: str) -> transformers.PreTrainedModel:
    config_class, kwargs = CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**{**COMMON, **kwargs}))
    with torch.no_grad():  # peaked attention and spread logits, so masking bugs show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if case != "gemma3" else 0.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.25)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    hf_model = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    files = load_model_files(path)
    assert files.config.architecture == request.param.split("_")[0]
    return hf_model, build_model(files, torch.float32)


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def test_full_prefill_matches_hf(models):
    hf_model, model = models
    tokens = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    caches = model.allocate_kv_cache(8, BLOCK)
    hidden = model(tokens, torch.arange(20), caches, single_sequence_metadata(20, BLOCK))
    torch.testing.assert_close(model.compute_logits(hidden), hf_logits(hf_model, tokens.tolist()), atol=1e-4, rtol=0)


def test_chunked_prefill_matches_hf(models):
    hf_model, model = models
    tokens = torch.randint(0, VOCAB, (22,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = hf_logits(hf_model, tokens)
    (seq,) = shuffled_tables(12, [22], seed=3)
    caches = garbage_cache(model, 12)
    for start, end in ((0, 5), (5, 13), (13, 22)):  # chunk boundaries inside blocks, chunks > window
        hidden = model(torch.tensor(tokens[start:end]), torch.arange(start, end), caches,
                       step_metadata([], [(seq, start, end)]))
        torch.testing.assert_close(model.compute_logits(hidden), expected[start:end], atol=1e-4, rtol=0)


def test_paged_greedy_decode_matches_hf(models):
    hf_model, model = models
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    new_tokens = 16
    reference = list(prompt)
    for _ in range(new_tokens):  # transformers recomputing the whole context: no cache semantics
        reference.append(int(hf_logits(hf_model, reference)[-1].argmax()))

    (seq,) = shuffled_tables(16, [len(prompt) + new_tokens], seed=5)
    caches = garbage_cache(model, 16)
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), caches, step_metadata([], [(seq, 0, len(prompt))]))
    generated = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    window = model.config.kv_window
    for pos in range(len(prompt), len(prompt) + new_tokens - 1):
        if window is not None:  # free what no layer reads any more: those slots now hold garbage
            for b in range((pos - window + 1) // BLOCK):
                seq.blocks[b] = 0
        hidden = model(torch.tensor([generated[-1]]), torch.tensor([pos]), caches,
                       step_metadata([(seq, pos)], [], pad_to=pos + 3))
        generated.append(int(model.compute_logits(hidden).argmax(-1)))
    assert generated == reference[len(prompt):]
    if window is not None:
        assert seq.blocks[0] == 0  # the test did free blocks
