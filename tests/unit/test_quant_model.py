"""Quantization at the model and engine level on tiny random models, and the perplexity tool.

References: the same model with the dequantized weights put back as float parameters (what the
quantized kernels must compute), the unquantized model (the quality criterion: logits cosine
similarity on a prompt), and transformers for perplexity.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from tessera import LLM, SamplingParams
from tessera.attention.metadata import single_sequence_metadata
from tessera.config import EngineConfig
from tessera.model.llama import LlamaForCausalLM
from tessera.model.weights import load_model_files
from tessera.quality import perplexity
from tessera.quant import QuantLinear, invariant, quantize_model, weight_memory_bytes
from tessera.quant.gguf_int8_activations import Q8BlocksLinear
from tessera.quant.linear import linear_weight_slots, replace_weight
from tests.tiny_model import write_gguf_from_hf_dir

PROMPT = [5, 70, 33, 101, 9, 250, 17, 88, 42, 3, 199, 64, 12, 7, 150, 31, 99, 2, 45, 180]


def load(path, method="none", **kw) -> LlamaForCausalLM:
    files = load_model_files(path)
    model = LlamaForCausalLM(files.config, torch.float32)
    model.load_weights(files.weights())
    return quantize_model(model, method, model_files=files, **kw)


def logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits of every position of `ids` run as one prefill."""
    caches = model.allocate_kv_cache(1 + -(-len(ids) // 16), 16)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, single_sequence_metadata(len(ids)))
    return model.compute_logits(hidden)


def decode_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits of the last position, computed as a one-token decode after a prefill of the rest:
    the M = 1 path (the bf16 / packed kernels)."""
    from tessera.attention.metadata import AttentionMetadata

    caches = model.allocate_kv_cache(1 + -(-len(ids) // 16), 16)
    n = len(ids) - 1
    model(torch.tensor(ids[:n]), torch.arange(n), caches, single_sequence_metadata(n))
    slots = single_sequence_metadata(len(ids)).slot_mapping
    md = AttentionMetadata(slot_mapping=slots[n:], num_decode_tokens=1, decode_slots=slots.view(1, -1),
                           decode_mask=torch.ones(1, 1, 1, len(ids), dtype=torch.bool), prefills=[])
    hidden = model(torch.tensor(ids[n:]), torch.tensor([n]), caches, md)
    return model.compute_logits(hidden)


def dequantized_twin(path, quantized: LlamaForCausalLM) -> LlamaForCausalLM:
    """The float model with every quantized weight replaced by its dequantized value."""
    twin = load(path)
    pairs = zip(linear_weight_slots(quantized, True), linear_weight_slots(twin, True), strict=True)
    for (owner, name, _), (twin_owner, _, _) in pairs:
        layer = getattr(owner, name)
        if isinstance(layer, QuantLinear):
            replace_weight(twin_owner, name, torch.nn.Parameter(layer.dequantize(), requires_grad=False))
    return twin


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


@pytest.mark.parametrize("method,kw", [("int8", {}), ("int4", {"group_size": 32}), ("int4", {"group_size": 64})])
def test_weight_only_model_computes_with_its_dequantized_weights(tiny_model_dir, method, kw):
    """Prefill (float32 kernels) equals the dequantized float model to 1e-4; a decode step (bf16
    kernels at M = 1) to the bf16 precision of activations, 2e-2 of the logits' range."""
    model = load(tiny_model_dir, method, quantize_lm_head=True, **kw)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * model.config.num_layers + 1
    twin = dequantized_twin(tiny_model_dir, model)
    torch.testing.assert_close(logits(model, PROMPT), logits(twin, PROMPT), rtol=1e-4, atol=1e-4)
    got, want = decode_logits(model, PROMPT), decode_logits(twin, PROMPT)
    assert (got - want).abs().max() <= 2e-2 * (want.max() - want.min())


@pytest.mark.parametrize("method,min_cosine", [("int8", 0.999), ("w8a8", 0.99), ("int4", 0.98)])
def test_quantized_logits_stay_close_to_float(tiny_model_dir, method, min_cosine):
    """The quality criterion on a prompt: cosine similarity of all positions' logits with the
    float model's, prefill and decode paths both."""
    ref = load(tiny_model_dir)
    model = load(tiny_model_dir, method, quantize_lm_head=True, group_size=32)
    assert cosine(logits(model, PROMPT), logits(ref, PROMPT)) > min_cosine
    assert cosine(decode_logits(model, PROMPT), decode_logits(ref, PROMPT)) > min_cosine


def test_tied_lm_head_gets_its_own_quantized_copy(tiny_model_factory):
    path = tiny_model_factory(tie_word_embeddings=True)
    model = load(path, "int8", quantize_lm_head=True)
    assert isinstance(model.lm_head, QuantLinear)
    assert isinstance(model.embed_tokens, torch.nn.Parameter)  # the lookup table stays float
    assert "lm_head" not in dict(model.named_parameters())
    assert cosine(logits(model, PROMPT), logits(load(path), PROMPT)) > 0.999


def test_weight_memory_counts_codes_and_scales(tiny_model_dir):
    float_model = load(tiny_model_dir)
    model = load(tiny_model_dir, "int8")
    slots = linear_weight_slots(float_model, quantize_lm_head=False)
    float_bytes = sum(getattr(o, n).numel() * 4 for o, n, _ in slots)
    if invariant.enabled():  # a code per weight and a float32 scale per row, padded to whole tiles
        int8_bytes = sum(np_ * kp + 4 * np_ for np_, kp in
                         (invariant.padded_shape(*getattr(o, n).shape) for o, n, _ in slots))
    else:  # a code per weight, a float32 and a bf16 scale per row
        int8_bytes = sum(getattr(o, n).numel() + 6 * getattr(o, n).shape[0] for o, n, _ in slots)
    assert weight_memory_bytes(model) == weight_memory_bytes(float_model) - float_bytes + int8_bytes


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_native_model_matches_the_dequantized_file(tiny_model_dir, tmp_path, qtype):
    """--quantization gguf keeps the blocks; its logits match the model loaded with the blocks
    dequantized to float (the loader's path) up to bf16 scales and activations, or int8 activations
    (gguf_int8_activations.py, on CPUs with AVX2 and no AVX-512)."""
    path = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / f"tiny-{qtype.name}.gguf", qtype=qtype)
    ref = load(path)
    model = load(path, "gguf", quantize_lm_head=True)
    kinds = {m.method for m in model.modules() if isinstance(m, QuantLinear)}
    assert kinds == {f"gguf {qtype.name}"}
    # The layers, the lm_head and (untied) the token_embd rows behind the embedding lookup.
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * model.config.num_layers + 2
    want = logits(ref, PROMPT)
    got = logits(model, PROMPT)
    int8_activations = any(isinstance(m, Q8BlocksLinear) for m in model.modules())  # AVX2-only CPUs
    if qtype == Q.Q8_0 and not int8_activations:  # the file's own codes and scales, dequantized exactly per call
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cosine(got, want) > 0.999
    assert cosine(decode_logits(model, PROMPT), decode_logits(ref, PROMPT)) > 0.999


def test_gguf_mode_needs_a_gguf_file(tiny_model_dir):
    with pytest.raises(ValueError, match="--model must be a .gguf file"):
        load(tiny_model_dir, "gguf")


def test_bad_quantization_arguments():
    with pytest.raises(ValueError, match="--quantization 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="--quant-group-size 48"):
        EngineConfig(quant_group_size=48)


def test_group_size_that_does_not_divide_names_the_layer(tiny_model_dir):
    with pytest.raises(ValueError, match=r"layers\.0\.qkv_proj .*group size 128 does not divide in_features 64"):
        load(tiny_model_dir, "int4", group_size=128)


@pytest.mark.parametrize("method", ["none", "int8", "int4", "w8a8"])
def test_engine_generates_with_each_mode(tiny_model_dir, method):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:15]]
    llm = LLM(str(tiny_model_dir), dtype="float32", quantization=method, quantize_lm_head=True,
              quant_group_size=32, kv_cache_memory=1 << 20)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    model = llm.engine.runner.model
    assert all(isinstance(getattr(o, n), QuantLinear) == (method != "none")
               for o, n, _ in linear_weight_slots(model, quantize_lm_head=True))
    # Batched decode (M = 3) gives what each prompt gets alone.
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_engine_gguf_mode(tiny_model_dir, tmp_path):
    path = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "tiny-q4_1.gguf", qtype=Q.Q4_1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = LLM(str(path), dtype="float32", quantization="gguf", kv_cache_memory=1 << 20).generate(
        [PROMPT], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


# ---- perplexity ------------------------------------------------------------------------------


def hf_window_nll(hf_model, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """The sliding-window scheme of tessera.quality, with transformers computing each window."""
    total, scored, next_target = 0.0, 0, 1
    for start in range(0, len(ids) - 1, stride):
        end = min(start + window, len(ids))
        with torch.inference_mode():
            out = hf_model(torch.tensor([ids[start:end]])).logits[0].float()
        rows = out[next_target - 1 - start : end - 1 - start]
        total += float(F.cross_entropy(rows, torch.tensor(ids[next_target:end]), reduction="sum"))
        scored += end - next_target
        next_target = end
        if end == len(ids):
            break
    return total, scored


@pytest.mark.parametrize("window,stride", [(200, 100), (40, 16), (37, 36)])
def test_perplexity_matches_transformers(tiny_model_dir, window, stride):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 260, (101,), generator=gen).tolist()
    result = perplexity(load(tiny_model_dir), ids, window=window, stride=stride)
    total, scored = hf_window_nll(hf, ids, window, stride)
    assert result.num_scored == scored == 100  # every token but the first, once
    assert result.perplexity == pytest.approx(math.exp(total / scored), rel=1e-5)


def test_perplexity_scores_each_token_once_with_its_intended_context(tiny_model_dir):
    """A naive reference, one forward pass per token: token t is scored once, with context
    ids[s:t], s the start of the first window (starts 0, stride, 2 stride, ...) that holds t
    past its overlap with the previous one: s = stride * max(0, ceil((t + 1 - window) / stride)).
    So every token sees min(t, window - stride) tokens of context at least. Windows longer
    than the 128 logit rows per chunk and a last window cut short by the text's end included."""
    model = load(tiny_model_dir)
    gen = torch.Generator().manual_seed(7)
    for n, window, stride in [(170, 150, 40), (61, 24, 23), (45, 20, 1)]:
        ids = torch.randint(0, 260, (n,), generator=gen).tolist()
        total = 0.0
        for t in range(1, n):
            s = stride * max(0, -(-(t + 1 - window) // stride))
            assert t - s >= min(t, window - stride) and t - s < window
            row = logits(model, ids[s:t])[-1:]
            total += float(F.cross_entropy(row, torch.tensor([ids[t]]), reduction="sum"))
        result = perplexity(model, ids, window=window, stride=stride)
        assert result.num_scored == n - 1
        assert result.perplexity == pytest.approx(math.exp(total / (n - 1)), rel=1e-5)


def test_perplexity_windows_must_overlap(tiny_model_dir):
    with pytest.raises(ValueError, match="stride must be in 1..window - 1"):
        perplexity(load(tiny_model_dir), list(range(50)), window=16, stride=16)


def test_shipped_text_is_a_few_thousand_tokens():
    from tessera.quality import DEFAULT_TEXT

    words = DEFAULT_TEXT.read_text(encoding="utf-8").split()
    assert 1500 <= len(words) <= 4000


@pytest.mark.parametrize(("method", "qtype"), [("gguf", Q.Q4_1), ("int4", None), ("int8", None)])
def test_quantized_buffers_lie_in_one_buffer_in_call_order(tiny_model_dir, tmp_path, method, qtype):
    """A decode step streams the quantized weights layer by layer, then the lm_head: their buffers
    are carved from one allocation in that order (pack_in_call_order), and the logits are the ones
    the layers give from buffers of their own."""
    path = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "t.gguf", qtype=qtype) if qtype else tiny_model_dir
    kw = {"quantize_lm_head": True} if method != "gguf" else {}
    model = load(path, method, **kw)
    slots = linear_weight_slots(model, quantize_lm_head=True)
    layers = [getattr(owner, name) for owner, name, _ in slots]
    assert all(isinstance(w, QuantLinear) for w in layers)
    held = [b for w in layers for sub in w.modules() for b in sub._buffers.values() if b is not None and b.numel()]
    starts = [b.data_ptr() for b in held]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert len({b.untyped_storage().data_ptr() for b in held}) == 1
    want = logits(model, PROMPT)
    for w in layers:  # the same layers with buffers of their own again
        for sub in w.modules():
            for name, b in list(sub._buffers.items()):
                if b is not None:
                    sub._buffers[name] = b.clone()
    assert torch.equal(logits(model, PROMPT), want)
