"""Same request, same answer (issue 16) on the default model, in bfloat16 and float32.

A greedy request's tokens must not depend on the prefix cache (hit or miss), on what else is in
its batch, on where its prefill chunks end, on a preemption (recompute or swap) or on streaming.
The reference is always the same request run alone on a plain engine (no prefix caching, the
whole prompt in one chunk), compared token for token.

Parsing the GGUF file and dequantizing its weights takes most of an engine's start-up, so the
module does both once and every engine here copies its weights from that (load_weights copies).
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

import tessera.engine.engine as engine_module
from tessera import SamplingParams
from tessera.config import EngineConfig
from tessera.engine.async_engine import AsyncLLMEngine
from tessera.engine.engine import LLMEngine
from tessera.kernels import cpu_has_avx512_bf16
from tessera.model.weights import load_model_files
from tessera.quant.gguf_native import on_int8_activations

# bfloat16 invariance is promised where the CPU has AVX-512 BF16 (docs/reproducibility.md); without
# it bf16 is emulated and these cases took 5 of a 15-minute suite on Zen 3 (session 31) to check
# what is not promised there.
DTYPES = [pytest.param("bfloat16", marks=pytest.mark.skipif(
              not cpu_has_avx512_bf16(), reason="bf16 invariance is promised only with AVX-512 BF16")),
          "float32"]
NUM_OUTPUT = 24
GREEDY = SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
TOPICS = ["a lighthouse keeper", "the first winter on Mars", "a cat who learns to code", "bread",
          "a river that flows uphill", "the last library", "two chess clocks", "a quiet volcano",
          "paged attention", "the history of salt", "a robot gardener", "an unfinished bridge",
          "the moon's laundry", "a map of forgotten roads", "tea ceremonies", "a very tall giraffe"]


class _LoadedOnce:
    """The model files with their weights dequantized once and kept (float32, ~0.5 GB)."""

    def __init__(self, files) -> None:
        self._files = files
        self._weights: list[tuple[str, torch.Tensor]] | None = None

    def __getattr__(self, name: str):
        return getattr(self._files, name)

    def weights(self):
        if self._weights is None:
            self._weights = list(self._files.weights())
        return iter(self._weights)


@pytest.fixture(scope="module", autouse=True)
def load_files_once():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "load_model_files", functools.cache(lambda path: _LoadedOnce(load_model_files(path))))
        yield


def make_engine(path, dtype: str, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 256 << 20)
    return LLMEngine(EngineConfig(model=str(path), dtype=dtype, **kw))


def chat_ids(engine: LLMEngine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """All prompts at once; the KV invariant checked after every step; tokens in prompt order."""
    base = f"g{engine.stats().prompt_tokens_total}-"
    for i, p in enumerate(prompts):
        engine.add_request(f"{base}{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
    assert engine.stats().kv_cache_usage == 0
    return [done[f"{base}{i}"] for i in range(len(prompts))]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def assert_all_equal(reference: list[int], variants: dict[str, list[int]]) -> None:
    """One assertion naming every variant that differs and where."""
    differ = {name: first_difference(reference, got) for name, got in variants.items() if got != reference}
    assert not differ, "differs from the request alone (first different output token): " + ", ".join(
        f"{name} at {at}" for name, at in differ.items())


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_france_question_three_times_with_prefix_caching_gives_one_answer(default_model_path, dtype):
    engine = make_engine(default_model_path, dtype, enable_prefix_caching=True)
    prompt = chat_ids(engine, FRANCE)
    params = SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0)
    answers = [generate(engine, [prompt], params)[0] for _ in range(3)]
    assert engine.stats().prefix_cache_hits > 0, "the second and third asks are meant to hit the prefix cache"
    texts = [engine.tokenizer.decode(a) for a in answers]
    assert texts[1] == texts[0] and texts[2] == texts[0], texts


@pytest.mark.parametrize("dtype", DTYPES)
def test_requests_on_a_shared_512_token_prefix_match_with_caching_on_and_off(default_model_path, dtype):
    # 32 requests in bf16, as the issue reported; 8 in float32, whose prefill costs about five times
    # bf16's on an AMX CPU (the caching-off run computes every request's 512-token prefix).
    num_requests = 32 if dtype == "bfloat16" else 8
    on = make_engine(default_model_path, dtype, enable_prefix_caching=True)
    off = make_engine(default_model_path, dtype, enable_prefix_caching=False)
    tok = on.tokenizer
    prefix = tok.encode("Paged attention keeps the key-value cache in fixed-size blocks, so memory is "
                        "allocated as tokens arrive and shared between requests. " * 30)[:512]
    prompts = [prefix + tok.encode(f" Question {i}: tell me about {TOPICS[i % 16]}.", add_special_tokens=False)
               for i in range(num_requests)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with_cache = generate(on, prompts, params)
    assert on.stats().prefix_cache_hits >= (num_requests - 1) * 512, "the shared prefix is meant to be a cache hit"
    without = generate(off, prompts, params)
    differ = [i for i in range(num_requests) if with_cache[i] != without[i]]
    assert not differ, f"{len(differ)} of {num_requests} requests differ with prefix caching on and off: {differ}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_alone_equals_it_batched_chunked_preempted_and_streamed(default_model_path, dtype):
    plain = make_engine(default_model_path, dtype, enable_prefix_caching=False)
    target = chat_ids(plain, [{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    others = [chat_ids(plain, [{"role": "user", "content": f"Write a short story about {t}." + " Please." * i}])
              for i, t in enumerate(TOPICS)]
    batch = others[:8] + [target] + others[8:]  # the target in the middle of 16 others
    alone = generate(plain, [target])[0]
    variants = {"in a batch of 16 (chunk budget 512)": generate(plain, batch)[8]}
    for budget in (16, 64):
        engine = make_engine(default_model_path, dtype, enable_prefix_caching=False, max_num_batched_tokens=budget)
        variants[f"chunk budget {budget}"] = generate(engine, batch)[8]

    # A pool of four of the longest requests: the batch of 17 must preempt to finish.
    longest = max(len(p) for p in batch) + NUM_OUTPUT
    kv_per_token = plain.model_config.kv_bytes_per_token(plain.dtype.itemsize)
    for mode in ("recompute", "swap"):
        engine = make_engine(default_model_path, dtype, enable_prefix_caching=False, preemption_mode=mode,
                             kv_cache_memory=4 * longest * kv_per_token, swap_space=0.25)
        variants[f"preempted by {mode}"] = generate(engine, batch)[8]
        stats = engine.stats()
        assert stats.num_preemptions > 0, f"{mode}: the pool is meant to force preemption"
        assert mode == "recompute" or stats.num_swapped_out_blocks > 0, "swap mode is meant to swap"

    served = make_engine(default_model_path, dtype)  # the server's defaults: prefix caching on
    variants["non-streamed (prefix-cache miss)"] = generate(served, [target])[0]
    streamed, final = asyncio.run(_stream_and_collect(AsyncLLMEngine(served), target))
    variants["streamed (prefix-cache hit)"] = streamed
    variants["non-streamed alongside the stream"] = final
    assert_all_equal(alone, variants)


@pytest.mark.skipif(not on_int8_activations(),
                    reason="the GGUF mode is not on int8 activations here (AMX, or no native kernels)")
def test_gguf_mode_on_int8_activations_alone_equals_batched_and_chunked(default_model_path, monkeypatch):
    """--quantization gguf on Zen 3 / Zen 4: Q4_1 layers and the Q8_0 lm_head on int8 activations,
    one kernel for every row count, so a request's tokens do not depend on its batch or its chunks
    (in the CPU's engine dtype: bf16 where it has AVX-512 BF16, the activations converted to float32
    for the kernels and back)."""
    monkeypatch.setattr(engine_module, "load_model_files", load_model_files)  # the GGUF file itself, not floats
    dtype = "bfloat16" if cpu_has_avx512_bf16() else "float32"
    plain = make_engine(default_model_path, dtype, quantization="gguf", enable_prefix_caching=False)
    target = chat_ids(plain, [{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    others = [chat_ids(plain, [{"role": "user", "content": f"Write a short story about {t}." + " Please." * i}])
              for i, t in enumerate(TOPICS)]
    batch = others[:8] + [target] + others[8:]
    alone = generate(plain, [target])[0]
    chunked = make_engine(default_model_path, dtype, quantization="gguf", enable_prefix_caching=False,
                          max_num_batched_tokens=16)
    assert_all_equal(alone, {"in a batch of 16 (chunk budget 512)": generate(plain, batch)[8],
                             "chunk budget 16": generate(chunked, batch)[8]})


async def _stream_and_collect(engine: AsyncLLMEngine, prompt: list[int]) -> tuple[list[int], list[int]]:
    """The prompt twice at once: one request consumed delta by delta (as an SSE stream is), one
    by its final output only (as a non-streamed HTTP request is)."""
    async def stream() -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, GREEDY, "streamed"):
            tokens += out.outputs[0].delta_token_ids
        return tokens

    async def final() -> list[int]:
        last = None
        async for out in engine.generate(prompt, GREEDY, "final"):
            last = out
        return last.outputs[0].token_ids

    try:
        return tuple(await asyncio.gather(stream(), final()))
    finally:
        engine.shutdown()
