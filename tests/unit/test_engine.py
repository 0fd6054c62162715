"""The engine end to end on a tiny random model, against transformers as the reference."""

from __future__ import annotations

import random

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tests.reference import hf_greedy


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def make_engine(path, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(path), **kw))


def run_to_completion(engine: LLMEngine, check: bool = True) -> dict:
    results = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        if check:
            engine.check_invariants()
        steps += 1
        assert steps < 10_000, "engine did not finish"
    assert engine.stats().kv_cache_usage == 0
    return results


def random_prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_batched_with_preemption_equals_alone_and_transformers(tiny_model_dir, hf_model):
    # A pool too small for 16 sequences at once forces preemption and recompute.
    vocab = hf_model.config.vocab_size
    prompts = random_prompts(16, vocab, seed=0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny_model_dir, block_size=4, kv_cache_memory=60 * 4 * 512, max_num_batched_tokens=32,
                         max_num_seqs=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    batched = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0, "the test is meant to force preemption"
    for i, p in enumerate(prompts):
        expected = hf_greedy(hf_model, p, 24)
        assert batched[str(i)].outputs[0].token_ids == expected, f"prompt {i}"
        alone = make_engine(tiny_model_dir)
        alone.add_request("x", p, params)
        assert run_to_completion(alone)["x"].outputs[0].token_ids == expected


def test_chunked_prefill_long_prompt_matches_transformers(tiny_model_dir, hf_model):
    prompt = random_prompts(1, hf_model.config.vocab_size, seed=3, lo=150, hi=150)[0]
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)  # 150 tokens in 10 chunks
    engine.add_request("long", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    out = run_to_completion(engine)["long"]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)


def test_seed_repeats_and_n_samples_differ(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    a = llm.generate("hello there", params, use_tqdm=False)[0]
    b = llm.generate(["other prompt", "hello there"], params, use_tqdm=False)[1]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert [o.index for o in a.outputs] == [0, 1, 2]


def test_stop_conditions(tiny_model_dir, hf_model):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    tok = llm.get_tokenizer()
    prompt = tok.encode("The quick brown fox")
    greedy = hf_greedy(hf_model, prompt, 20)
    # max_tokens -> "length"
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == greedy[:5]
    # a stop token id -> "stop", the token is the last one generated
    stop_id = greedy[6]
    first = greedy.index(stop_id)
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == greedy[: first + 1]
    # a stop string -> the text is cut before it
    full = tok.decode(greedy)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if stop.strip():
        out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text == full[: full.index(stop)]


def test_streamed_deltas_add_up(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.add_request("s", "stream me", SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True,
                                                        stop=["ab", "xyz"]))
    text, tokens, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].delta_text
            tokens += out.outputs[0].delta_token_ids
            final = out
    assert text == final.outputs[0].text and tokens == final.outputs[0].token_ids


def test_final_only_requests_get_one_output_with_the_streamed_text(tiny_model_dir):
    """FINAL_ONLY (what LLM.generate asks for): no output before the end, and the text decoded once
    at the end is the text a streamed request builds token by token (random tokens of the tiny
    vocabulary make incomplete UTF-8 that the deltas hold back). With a stop string the text is
    decoded as it goes, and the cut is the streamed one too."""
    from dataclasses import replace

    from tessera import RequestOutputKind

    engine = make_engine(tiny_model_dir)
    base = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    base.append(SamplingParams(max_tokens=40, temperature=1.0, seed=9, ignore_eos=True, stop=["e"]))

    def run(kind):
        outputs = {}
        for i, p in enumerate(base):
            engine.add_request(f"{kind.name}{i}", "final only", replace(p, output_kind=kind))
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id.removeprefix(kind.name), []).append(out)
        return outputs

    streamed, final = run(RequestOutputKind.CUMULATIVE), run(RequestOutputKind.FINAL_ONLY)
    assert all(len(outs) == 1 and outs[0].finished for outs in final.values())
    assert any(len(outs) > 1 for outs in streamed.values())
    for i, outs in streamed.items():
        want, got = outs[-1].outputs[0], final[i][0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks  # nothing held after


def test_logprobs_match_transformers(tiny_model_dir, hf_model):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    prompt = [5, 17, 99, 23, 42]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    ids = list(prompt)
    with torch.inference_mode():
        for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)
            assert tok in entry and entry[tok].rank == 1
            assert abs(entry[tok].logprob - float(ref[tok])) < 1e-4
            top = torch.topk(ref, 3).indices.tolist()
            assert set(top) <= set(entry)
            ids.append(tok)


def test_abort_frees_blocks_and_others_continue(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine.add_request("keep", [1, 2, 3, 4, 5], params)
    engine.add_request("drop", list(range(10, 40)), params)
    for _ in range(3):
        engine.step()
    engine.abort_request("drop")
    engine.check_invariants()
    out = run_to_completion(engine)
    assert set(out) == {"keep"}
    assert out["keep"].outputs[0].token_ids == hf_greedy(hf_model, [1, 2, 3, 4, 5], 10)


def test_bad_input_errors_name_the_limit(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_model_len=64)
    with pytest.raises(ValueError, match="64.*--max-model-len|--max-model-len.*64"):
        engine.add_request("long", list(range(100)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [10**7], SamplingParams())
    small = make_engine(tiny_model_dir, block_size=4, kv_cache_memory=4 * 4 * 512)  # 4 blocks = 16 tokens
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        small.add_request("big", list(range(40)), SamplingParams(max_tokens=8))
    assert not small.has_unfinished_requests() and small.stats().kv_cache_usage == 0
