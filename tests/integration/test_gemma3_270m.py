"""The second packaged model, Gemma 3 270M (Q4_K_M GGUF), against transformers loading the same file.

transformers dequantizes the GGUF's K-quant, Q5_0 and Q8_0 tensors to float32 itself (its own
gguf integration, norms shifted back by -1 as ours are), so both sides compute with the same
weights: logits, greedy tokens through the engine (batched, prompts sharing a prefix served from
the prefix cache) and the perplexity of the shipped text must agree.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tessera import LLM, SamplingParams
from tessera.attention.metadata import single_sequence_metadata
from tessera.quality import perplexity, text_token_ids
from tests.reference import hf_greedy

pytestmark = pytest.mark.integration

SHARED = "You are a careful assistant. Answer in one short paragraph, plainly and precisely.\n\n"
PROMPTS = [
    SHARED + "Question: Why is the sky blue?\nAnswer:",
    SHARED + "Question: What does a compiler do?\nAnswer:",
    SHARED + "Question: How do bees make honey?\nAnswer:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_path():
    from tessera.model.download import resolve_model_path

    return resolve_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def llm(gemma_path):
    return LLM(str(gemma_path), dtype="float32", kv_cache_memory=256 << 20, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf_model(gemma_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name,
                                                dtype=torch.float32).eval()


def test_config_is_gemma3_270m(llm):
    mc = llm.engine.model_config
    assert (mc.architecture, mc.num_layers, mc.head_dim, mc.num_kv_heads, mc.vocab_size) == ("gemma3", 18, 256, 1, 262144)
    assert mc.layer_types.count("full_attention") == 3 and mc.sliding_window == 512


def test_prompt_logits_match_transformers(llm, hf_model):
    ids = llm.get_tokenizer().encode(PROMPTS[0] + " " + PROMPTS[3])
    model = llm.engine.runner.model
    caches = model.allocate_kv_cache(num_blocks=1 + -(-len(ids) // 16), block_size=16)
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), caches,
                                          single_sequence_metadata(len(ids))))
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_tokens_match_transformers_batched_with_prefix_cache(llm, hf_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)  # puts the shared prefix in the cache
    hits_before = llm.engine.stats().prefix_cache_hits
    outs = llm.generate(PROMPTS, params, use_tqdm=False)  # batched together through the engine
    assert llm.engine.stats().prefix_cache_hits - hits_before >= 3 * 16  # the shared prefix was reused
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, tok.encode(prompt), NEW_TOKENS), prompt


def test_perplexity_of_the_shipped_text_matches_transformers(llm, hf_model):
    ids = text_token_ids(llm.get_tokenizer())[:300]
    ours = perplexity(llm.engine.runner.model, ids, window=300, stride=299)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    ref = math.exp(float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))))
    assert ours.num_scored == len(ids) - 1
    assert ours.perplexity == pytest.approx(ref, rel=1e-4)


@pytest.fixture(scope="module")
def gguf_llm(gemma_path):
    return LLM(str(gemma_path), dtype="float32", quantization="gguf", kv_cache_memory=256 << 20)


def test_gguf_mode_perplexity_is_within_2_percent_of_transformers(gguf_llm, hf_model):
    """--quantization gguf computes every linear from the file's blocks (Q5_0, Q4_K, Q6_K and the tied
    Q8_0 lm_head); on x86 without AMX on int8 activations, llama.cpp's arithmetic, whose rounding of x
    moves the perplexity (0.9% on Zen 4) where a broken kernel would move it by far more."""
    from tessera.quant.gguf_int8_activations import Q4BlocksLinear, Q8BlocksLinear
    from tessera.quant.gguf_native import ConcatLinear, on_int8_activations
    from tessera.quant.linear import QuantLinear

    model = gguf_llm.engine.runner.model
    if on_int8_activations():
        layers = [m for m in model.modules() if isinstance(m, QuantLinear) and not isinstance(m, ConcatLinear)]
        assert len(layers) >= 18 * 4 + 1 and all(isinstance(m, Q4BlocksLinear | Q8BlocksLinear) for m in layers)
    ids = text_token_ids(gguf_llm.get_tokenizer())[:300]
    ours = perplexity(model, ids, window=300, stride=299)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    ref = math.exp(float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))))
    assert ours.perplexity == pytest.approx(ref, rel=0.02)


def test_gguf_mode_stack_equals_modules(gemma_path):
    """The native Gemma stack (gemma_stack.py) on the file's blocks, in bf16 (the mode's benchmarked
    dtype), gives the modules' (--enforce-eager) tokens and logprobs bit for bit, through batched
    prompts that share a prefix."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = []
    for eager in (False, True):
        llm = LLM(str(gemma_path), dtype="bfloat16", quantization="gguf", kv_cache_memory=256 << 20,
                  enforce_eager=eager)
        stack = llm.engine.runner.model.native_stack
        if not eager and stack is None:
            pytest.skip("no native Gemma stack here (bf16 and its norm need AVX-512 BF16)")
        assert (stack is None) == eager
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        del llm
    assert runs[0] == runs[1]
