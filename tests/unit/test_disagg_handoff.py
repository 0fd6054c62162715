"""KV handoff between two engines in one process: a prompt prefilled on engine A and decoded on
engine B gives, token for token, what one engine gives on its own (greedy and seeded sampling),
with only the rows B's prefix cache lacked copied, and the KV invariant holding on both engines
after every step. Also: a sequence resumed without K/V (an engine died) recomputes and streams on."""

from __future__ import annotations

import random

import pytest
import torch

from tessera import SamplingParams
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine

TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32


def make_engine(path, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 2048 * TINY_KV_BYTES_PER_TOKEN)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", max_num_batched_tokens=64, **kw))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return make_engine(tiny_model_dir), make_engine(tiny_model_dir), make_engine(tiny_model_dir)


def colocated(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"c{i}", p, sp)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
    return [results[f"c{i}"] for i in range(len(prompts))]


def disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts, params) -> tuple[list[list[int]], list[str]]:
    """Prompts arrive together on `prefill`; each one's handoff is imported into `decode` as soon
    as it appears, while decode is already stepping the earlier ones. Returns the token ids each
    request streamed (prefill's first token, then decode's deltas) and the streamed texts."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        prefill.add_request(f"d{i}", p, sp, handoff=True)
    tokens: dict[str, list[int]] = {f"d{i}": [] for i in range(len(prompts))}
    texts: dict[str, str] = dict.fromkeys(tokens, "")
    done: set[str] = set()
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        for engine in (prefill, decode):
            if not engine.has_unfinished_requests():
                continue
            for out in engine.step():
                c = out.outputs[0]
                tokens[out.request_id] += c.delta_token_ids
                texts[out.request_id] += c.delta_text
                handoff = prefill.take_handoff(out.request_id) if engine is prefill else None
                if handoff is not None:
                    assert c.finish_reason is None and out.finished
                    decode.import_handoff(*handoff)
                elif out.finished:
                    assert c.finish_reason is not None
                    done.add(out.request_id)
            engine.check_invariants()
    assert done == set(tokens)
    assert prefill.stats().kv_cache_usage == 0 and decode.stats().kv_cache_usage == 0
    return [tokens[f"d{i}"] for i in range(len(prompts))], [texts[f"d{i}"] for i in range(len(prompts))]


def test_prefill_on_a_decode_on_b_equals_colocated(engines):
    ref_engine, prefill, decode = engines
    rng = random.Random(0)
    shared = [rng.randrange(260) for _ in range(40)]
    prompts = [
        [rng.randrange(260) for _ in range(5)],
        [rng.randrange(260) for _ in range(16)],  # exactly one block: the first token starts block 2
        [rng.randrange(260) for _ in range(150)],  # several prefill chunks
        shared + [rng.randrange(260) for _ in range(7)],
        shared + [rng.randrange(260) for _ in range(30)],  # decode's prefix cache holds 2 blocks of it
    ]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    params = [greedy, greedy, seeded, greedy, greedy]
    expected = colocated(ref_engine, prompts, params)
    hits_before = decode.kv.prefix_hits
    got, _ = disaggregated(prefill, decode, prompts, params)
    assert got == expected
    # The second prompt with the shared prefix found its first two blocks cached on the decode
    # engine (registered when the first one was imported) and got only the rest copied.
    assert decode.kv.prefix_hits - hits_before >= 32


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_caches_hand_off_their_codes_and_scales(tiny_model_dir, kv_cache_dtype):
    """With a 1-byte KV cache the handoff carries codes and scales: decode on B equals one engine."""
    ref, prefill, decode = (make_engine(tiny_model_dir, kv_cache_dtype=kv_cache_dtype) for _ in range(3))
    rng = random.Random(1)
    prompts = [[rng.randrange(260) for _ in range(n)] for n in (9, 40, 70)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * len(prompts)
    got, _ = disaggregated(prefill, decode, prompts, params)
    assert got == colocated(ref, prompts, params)


def test_first_token_that_ends_the_request_stays_on_prefill(engines):
    """max_tokens=1, or an EOS first token: the request finishes on the prefill engine with its
    own finish_reason; nothing is handed off."""
    _, prefill, _ = engines
    prefill.add_request("one", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0), handoff=True)
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert prefill.take_handoff("one") is None


def test_resume_without_kv_recomputes_and_streams_on(engines, tiny_model_dir):
    """An engine died after streaming 5 tokens: another one takes prompt + those 5 tokens with no
    K/V, recomputes them and streams exactly the tokens the colocated run had next."""
    ref_engine, _, decode = engines
    from tessera.engine.handoff import SequenceHandoff

    prompt = list(range(20, 80))
    params = SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True)
    (expected,) = colocated(ref_engine, [prompt], [params])
    handoff = SequenceHandoff("r", prompt, expected[:5], params)
    decode.import_handoff(handoff)
    streamed = []
    while decode.has_unfinished_requests():
        for out in decode.step():
            streamed += out.outputs[0].delta_token_ids
        decode.check_invariants()
    assert streamed == expected[5:]


def test_abort_while_waiting_to_import_frees_nothing_twice(tiny_model_dir):
    """An import queued for want of batch room, aborted before it got in, leaves no trace."""
    small = make_engine(tiny_model_dir, max_num_seqs=1)
    prefill = make_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    small.add_request("busy", [1, 2, 3], params)
    small.step()
    for rid in ("a", "b"):
        prefill.add_request(rid, list(range(10, 40)), params, handoff=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    small.import_handoff(*prefill.take_handoff("a"))
    small.import_handoff(*prefill.take_handoff("b"))
    small.abort_request("a")
    small.check_invariants()
    finished = set()
    while small.has_unfinished_requests():
        finished |= {o.request_id for o in small.step() if o.finished}
        small.check_invariants()
    assert finished == {"busy", "b"}
    assert small.stats().kv_cache_usage == 0


def test_handoff_kv_is_exactly_the_prompt_rows(engines):
    """The exported tensor holds the prompt's rows of the prefill engine's cache, in order."""
    _, prefill, _ = engines
    prompt = list(range(200, 237))
    prefill.add_request("x", prompt, SamplingParams(max_tokens=3, temperature=0.0), handoff=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    handoff, kv = prefill.take_handoff("x")
    assert handoff.num_kv_tokens == len(prompt)
    # Recompute the prompt's K/V on a fresh pass through the same model: prefill the same prompt
    # again with caching off and read its rows straight from the cache.
    other = make_engine(prefill.config.model, enable_prefix_caching=False)
    other.add_request("y", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    other.step()  # one chunk of 64 tokens covers the prompt
    seq = other.scheduler.running[0]
    from tessera.engine.handoff import kv_parts

    caches = other.runner.kv_caches
    got = kv_parts(caches, kv, len(prompt))
    rows = torch.tensor([seq.block_table[p // 16] * 16 + p % 16 for p in range(len(prompt))])
    for layer, parts in zip(caches, got, strict=True):
        for cache, part in zip(layer, parts, strict=True):
            torch.testing.assert_close(part, cache[rows])
