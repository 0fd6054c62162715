"""LlamaForCausalLM over the paged KV cache vs Hugging Face transformers on tiny random models.

Every check compares to transformers run in the same process (no captured outputs): full
prefill, chunked prefill, greedy decode through shuffled block tables whose unused slots hold
NaN, a mixed batch (decodes + prefill chunks of other sequences in the same step), and bf16.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from tessera.attention.metadata import AttentionMetadata, PrefillSpan, single_sequence_metadata, slots_for_positions
from tessera.config import ModelConfig
from tessera.model.llama import LlamaForCausalLM

VOCAB, HIDDEN, HEAD_DIM, LAYERS = 256, 64, 16, 2
BLOCK = 4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so the scaling bites at head_dim 16
}
CASES = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "mqa": dict(num_key_value_heads=1),
    "llama3_rope": dict(num_key_value_heads=2, rope_scaling=LLAMA3_ROPE),
    "linear_rope": dict(num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "yarn_rope": dict(num_key_value_heads=2, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 32}),
    # dynamic NTK equals the unscaled rope within max_position_embeddings, where tessera stops
    "dynamic_rope": dict(num_key_value_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2_bias": dict(num_key_value_heads=2, qwen2=True),
}


def make_hf_model(case: str, seed: int = 0) -> transformers.PreTrainedModel:
    kwargs = dict(CASES[case])
    qwen2 = kwargs.pop("qwen2", False)
    kwargs.setdefault("tie_word_embeddings", False)
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=128, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **kwargs,
    )
    torch.manual_seed(seed)
    if qwen2:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    # HF's 0.02 init makes attention nearly uniform, which would hide masking and slot bugs:
    # larger weights give peaked attention and spread logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.25)
    return model.eval()


def to_model_config(hf_config) -> ModelConfig:
    """Our ModelConfig from a transformers config object (the test's own small converter)."""
    rope = dict(hf_config.rope_parameters or {})
    theta = rope.pop("rope_theta", 10000.0)
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    return ModelConfig(
        architecture=hf_config.model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=hf_config.tie_word_embeddings,
        attention_bias=hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
    )


def make_ours(hf_model, dtype=torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM(to_model_config(hf_model.config), dtype)
    model.load_weights(hf_model.state_dict().items())
    return model


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


class PagedSequence:
    """One sequence's shuffled block table over a cache shared with other sequences."""

    def __init__(self, blocks: list[int]):
        self.blocks = blocks
        self.num_cached = 0

    def slots(self, start: int, end: int) -> torch.Tensor:
        return torch.tensor(slots_for_positions(self.blocks, start, end, BLOCK), dtype=torch.long)


def garbage_cache(model: LlamaForCausalLM, num_blocks: int, dtype=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A cache whose every slot is NaN except block 0 (the padding target, which must stay
    finite: it holds large finite garbage), so reading any slot not written this test fails."""
    caches = model.allocate_kv_cache(num_blocks, BLOCK, dtype)
    for k_cache, v_cache in caches:
        for cache in (k_cache, v_cache):
            cache.fill_(float("nan"))
            cache[:BLOCK] = 1e3 * torch.randn_like(cache[:BLOCK])
    return caches


def shuffled_tables(num_blocks: int, sizes: list[int], seed: int) -> list[PagedSequence]:
    free = list(range(1, num_blocks))  # block 0 is never handed out
    random.Random(seed).shuffle(free)
    seqs = []
    for size in sizes:
        n = -(-size // BLOCK)
        seqs.append(PagedSequence(free[:n]))
        free = free[n:]
    return seqs


def step_metadata(decodes: list[tuple[PagedSequence, int]], prefills: list[tuple[PagedSequence, int, int]], pad_to: int = 0):
    """Metadata of one mixed step. decodes: (seq, position of the new token); prefills:
    (seq, start, end) chunks. Decode contexts are padded to at least `pad_to` slots."""
    slot_parts, spans = [], []
    decode_slots = decode_mask = None
    if decodes:
        lens = [pos + 1 for _, pos in decodes]
        width = max(max(lens), pad_to)
        decode_slots = torch.zeros(len(decodes), width, dtype=torch.long)
        decode_mask = torch.zeros(len(decodes), 1, 1, width, dtype=torch.bool)
        for i, (seq, pos) in enumerate(decodes):
            decode_slots[i, : pos + 1] = seq.slots(0, pos + 1)
            decode_mask[i, ..., : pos + 1] = True
            slot_parts.append(seq.slots(pos, pos + 1))
    query_start = len(decodes)
    for seq, start, end in prefills:
        spans.append(PrefillSpan(query_start, end - start, end, seq.slots(0, end)))
        slot_parts.append(seq.slots(start, end))
        query_start += end - start
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_parts), num_decode_tokens=len(decodes),
        decode_slots=decode_slots, decode_mask=decode_mask, prefills=spans,
    )


@pytest.fixture(scope="module", params=list(CASES))
def models(request):
    hf_model = make_hf_model(request.param)
    return hf_model, make_ours(hf_model)


def test_full_prefill_logits_match_hf(models):
    hf_model, model = models
    tokens = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(1))
    caches = model.allocate_kv_cache(8, BLOCK)
    hidden = model(tokens, torch.arange(13), caches, single_sequence_metadata(13, BLOCK))
    logits = model.compute_logits(hidden)
    expected = hf_logits(hf_model, tokens.tolist())
    assert logits.dtype == torch.float32 and logits.shape == (13, VOCAB)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_chunked_prefill_matches_hf(models):
    hf_model, model = models
    tokens = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = hf_logits(hf_model, tokens)
    (seq,) = shuffled_tables(12, [14], seed=3)
    caches = garbage_cache(model, 12)
    for start, end in ((0, 5), (5, 9), (9, 14)):  # chunk boundaries inside blocks
        md = step_metadata([], [(seq, start, end)])
        hidden = model(torch.tensor(tokens[start:end]), torch.arange(start, end), caches, md)
        torch.testing.assert_close(model.compute_logits(hidden), expected[start:end], atol=1e-4, rtol=0)


def test_greedy_decode_matches_hf_generate(models):
    hf_model, model = models
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    new_tokens = 20
    with torch.no_grad():
        reference = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        )[0, len(prompt):].tolist()

    (seq,) = shuffled_tables(16, [len(prompt) + new_tokens], seed=5)
    caches = garbage_cache(model, 16)
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), caches, step_metadata([], [(seq, 0, len(prompt))]))
    generated = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    for pos in range(len(prompt), len(prompt) + new_tokens - 1):
        md = step_metadata([(seq, pos)], [], pad_to=pos + 3)  # padded columns must be masked out
        hidden = model(torch.tensor([generated[-1]]), torch.tensor([pos]), caches, md)
        generated.append(int(model.compute_logits(hidden).argmax(-1)))
    assert generated == reference


def test_mixed_batch_matches_each_sequence_alone(models):
    """Three sequences of different lengths: two prefilled together, then decoding while the
    third is prefilled in two chunks in the same steps, then all three decoding in one batch.
    Every logit row must equal HF's on that sequence alone."""
    hf_model, model = models
    gen = torch.Generator().manual_seed(6)
    lengths = {"a": 5, "b": 11, "c": 9}  # prompt lengths
    total = 18
    tokens = {name: torch.randint(0, VOCAB, (total,), generator=gen).tolist() for name in lengths}
    expected = {name: hf_logits(hf_model, toks) for name, toks in tokens.items()}
    seqs = dict(zip(lengths, shuffled_tables(24, [total] * 3, seed=7), strict=True))
    caches = garbage_cache(model, 24)
    pos = {"a": 0, "b": 0, "c": 0}  # tokens already in the cache

    def run(decode_names: list[str], chunks: list[tuple[str, int]]) -> None:
        decodes = [(seqs[n], pos[n]) for n in decode_names]
        prefills = [(seqs[n], pos[n], pos[n] + size) for n, size in chunks]
        ids = [tokens[n][pos[n]] for n in decode_names]
        positions = [pos[n] for n in decode_names]
        rows = [(n, pos[n], pos[n] + 1) for n in decode_names]
        for n, size in chunks:
            ids += tokens[n][pos[n] : pos[n] + size]
            positions += range(pos[n], pos[n] + size)
            rows.append((n, pos[n], pos[n] + size))
        hidden = model(torch.tensor(ids), torch.tensor(positions), caches, step_metadata(decodes, prefills))
        logits = model.compute_logits(hidden)
        row = 0
        for n, start, end in rows:
            torch.testing.assert_close(logits[row : row + end - start], expected[n][start:end], atol=1e-4, rtol=0)
            row += end - start
            pos[n] = end

    run([], [("a", 5), ("b", 11)])
    run(["a", "b"], [("c", 6)])
    run(["a", "b"], [("c", 3)])
    while pos["a"] < total:
        run(["a", "b", "c"] if pos["b"] < total else ["a"], [])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_bf16_stays_close_to_fp32(cache_dtype):
    hf_model = make_hf_model("gqa")
    fp32, bf16 = make_ours(hf_model), make_ours(hf_model, torch.bfloat16)
    assert bf16.layers[0].self_attn.qkv_proj.dtype == torch.bfloat16
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    results = []
    for model, dtype in ((fp32, None), (bf16, cache_dtype)):
        (seq,) = shuffled_tables(8, [12], seed=9)
        caches = garbage_cache(model, 8, dtype)
        hidden = model(torch.tensor(tokens[:8]), torch.arange(8), caches, step_metadata([], [(seq, 0, 8)]))
        rows = [model.compute_logits(hidden)]
        for p in range(8, 12):
            hidden = model(torch.tensor([tokens[p]]), torch.tensor([p]), caches, step_metadata([(seq, p)], []))
            rows.append(model.compute_logits(hidden))
        results.append(torch.cat(rows))
    ref, low = results
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    # bf16 keeps ~3 significant digits; logits here span about +-10.
    scale = ref.abs().max()
    assert (low - ref).abs().max() < 0.05 * scale
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_load_weights_reports_missing_unexpected_and_misshapen():
    hf_model = make_hf_model("gqa")
    state = dict(hf_model.state_dict())
    model = LlamaForCausalLM(to_model_config(hf_model.config))
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*layers\.1\.mlp\.up_proj"):
        model.load_weights(missing.items())
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        model.load_weights([*state.items(), ("model.layers.0.self_attn.q_proj.bias", torch.zeros(64))])
    bad = dict(state, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)})
    with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(16, 64\), expected \(32, 64\)"):
        model.load_weights(bad.items())
