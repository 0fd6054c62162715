"""Speculative decoding end to end on a tiny random model: exactness against plain decoding and
transformers, KV rollback, stop conditions, and the engine-level sampled distribution."""

from __future__ import annotations

import random

import pytest
import torch

from tessera import SamplingParams
from tessera.engine.sampler import filter_logits
from tests.unit.test_engine import hf_greedy, make_engine, run_to_completion
from tests.unit.test_sampler import chi_square_p_value


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def repetitive_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """A random phrase said a few times, so n-gram lookup has something to find."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(vocab) for _ in range(rng.randint(2, 10))]
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(0, 5))] + phrase * rng.randint(2, 5))
    return prompts


def run_checked(engine, check_blocks: bool = True) -> dict:
    """Step to the end; after every step check the KV invariant and that no sequence keeps a
    block past the one its next token goes to (rejected proposals were rolled back)."""
    results = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        engine.check_invariants()
        if check_blocks:
            for seq in engine.scheduler.running:
                assert len(seq.block_table) <= engine.kv.num_blocks_for(seq.num_tokens), (
                    f"seq {seq.seq_id} holds {len(seq.block_table)} blocks for {seq.num_tokens} tokens")
        steps += 1
        assert steps < 10_000
    assert engine.stats().kv_cache_usage == 0
    return results


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_ngram_equals_plain_and_transformers_with_preemption(tiny_model_dir, hf_model, k):
    vocab = hf_model.config.vocab_size
    prompts = repetitive_prompts(12, vocab, seed=k)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    # A pool too small for 12 sequences at once: preemption (recompute) while speculating.
    engine = make_engine(tiny_model_dir, block_size=4, kv_cache_memory=60 * 4 * 512, max_num_batched_tokens=64,
                         max_num_seqs=12, speculative_method="ngram", num_speculative_tokens=k,
                         speculative_adaptive=False)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    spec = run_checked(engine)
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the test is meant to force preemption"
    assert stats.spec_num_accepted_tokens > 20, "the prompts are meant to get proposals accepted"
    assert stats.spec_num_accepted_tokens < stats.spec_num_proposed_tokens, "and some rejected"
    for i, p in enumerate(prompts):
        assert spec[str(i)].outputs[0].token_ids == hf_greedy(hf_model, p, 30), f"prompt {i}"


@pytest.fixture(scope="module")
def draft_models(tiny_model_dir, tmp_path_factory):
    """Drafts for the tiny target: itself (proposals always right) and a noisy copy, its weights
    perturbed (proposals often right, often not)."""
    import shutil

    from safetensors.torch import load_file, save_file

    noisy = tmp_path_factory.mktemp("noisy_draft")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, noisy / f.name)
    weights = load_file(noisy / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if w.dim() == 2:
            weights[name] = w + 0.5 * w.std() * torch.randn(w.shape, generator=gen)
    save_file(weights, noisy / "model.safetensors", metadata={"format": "pt"})
    return {"self": tiny_model_dir, "noisy": noisy}


@pytest.mark.parametrize("draft", ["self", "noisy"])
@pytest.mark.parametrize("k", [2, 4])
def test_greedy_draft_equals_transformers_with_preemption(tiny_model_dir, hf_model, draft_models, draft, k):
    vocab = hf_model.config.vocab_size
    prompts = repetitive_prompts(8, vocab, seed=20 + k)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny_model_dir, block_size=4, kv_cache_memory=50 * 4 * 512, max_num_batched_tokens=64,
                         max_num_seqs=8, speculative_method="draft", draft_model=str(draft_models[draft]),
                         num_speculative_tokens=k, speculative_adaptive=False)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    spec = run_checked(engine)
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the test is meant to force preemption"
    if draft == "self":
        assert stats.spec_acceptance_rate > 0.95
    else:
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_proposed_tokens
    assert engine.spec.proposer.kv.usage == 0, "finished sequences gave the draft's blocks back"
    for i, p in enumerate(prompts):
        assert spec[str(i)].outputs[0].token_ids == hf_greedy(hf_model, p, 24), f"prompt {i}"


def test_adaptive_greedy_equals_plain(tiny_model_dir):
    vocab = 267
    prompts = repetitive_prompts(6, vocab, seed=11)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs = []
    for kw in ({}, dict(speculative_method="ngram", num_speculative_tokens=4)):
        engine = make_engine(tiny_model_dir, **kw)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outputs.append({rid: o.outputs[0].token_ids for rid, o in run_checked(engine).items()})
    assert outputs[0] == outputs[1]
    stats = engine.stats()
    assert stats.spec_num_steps_on + stats.spec_num_steps_off > 0


def test_seeded_sampling_with_ngram_gives_the_same_tokens(tiny_model_dir):
    # Point-mass verification draws each output token with plain decoding's noise, in plain
    # decoding's order, so a seeded request is reproduced token for token.
    prompts = repetitive_prompts(5, 267, seed=5)
    outputs = []
    for kw in ({}, dict(speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False)):
        engine = make_engine(tiny_model_dir, **kw)
        for i, p in enumerate(prompts):
            # Low temperature and top-k: the samples repeat themselves, so proposals get accepted.
            engine.add_request(str(i), p, SamplingParams(max_tokens=30, temperature=0.3, top_k=5, seed=100 + i,
                                                         ignore_eos=True))
        outputs.append({rid: o.outputs[0].token_ids for rid, o in run_checked(engine).items()})
    assert outputs[0] == outputs[1]
    assert engine.stats().spec_num_accepted_tokens > 0


def test_stop_conditions_apply_token_by_token(tiny_model_dir, hf_model):
    prompt = repetitive_prompts(1, 267, seed=2)[0]
    greedy = hf_greedy(hf_model, prompt, 40)
    engine = make_engine(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=6,
                         speculative_adaptive=False)
    stop_id = greedy[9]
    engine.add_request("stop_id", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                         stop_token_ids=[stop_id]))
    engine.add_request("length", prompt, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    out = run_checked(engine)
    first = greedy.index(stop_id)
    assert out["stop_id"].outputs[0].token_ids == greedy[: first + 1]
    assert out["stop_id"].outputs[0].finish_reason == "stop"
    assert out["length"].outputs[0].token_ids == greedy[:7]
    assert out["length"].outputs[0].finish_reason == "length"


def test_penalties_and_logprobs_do_not_speculate(tiny_model_dir):
    prompt = repetitive_prompts(1, 267, seed=3)[0]
    engine = make_engine(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=3,
                         speculative_adaptive=False)
    engine.add_request("pen", prompt, SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3))
    engine.add_request("lp", prompt, SamplingParams(max_tokens=10, temperature=0, logprobs=2))
    run_checked(engine)
    assert engine.stats().spec_num_proposed_tokens == 0


def test_rollback_frees_rejected_blocks(tiny_model_dir):
    # block_size 2 and k=8: a verification takes up to 5 more blocks; after it, a sequence must
    # hold no block past the one its next token goes to.
    engine = make_engine(tiny_model_dir, block_size=2, speculative_method="ngram", num_speculative_tokens=8,
                         speculative_adaptive=False)
    held_during_step = []
    prepare = engine.runner.prepare

    def recording_prepare(scheduled, num_decodes, spec_tokens=None):
        held_during_step.append(max(len(seq.block_table) - engine.kv.num_blocks_for(seq.num_tokens)
                                    for seq, _ in scheduled))
        return prepare(scheduled, num_decodes, spec_tokens)

    engine.runner.prepare = recording_prepare
    engine.add_request("r", [7, 8, 9, 10, 11, 12] * 2 + [3], SamplingParams(max_tokens=40, temperature=0,
                                                                             ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= engine.kv.num_blocks_for(seq.num_tokens)
            assert seq.num_computed_tokens == seq.num_tokens - 1
    stats = engine.stats()
    assert max(held_during_step) >= 3, "verifications should have taken blocks for their proposals"
    assert stats.spec_num_proposed_tokens > stats.spec_num_accepted_tokens, "and some were rejected"
    assert stats.kv_cache_usage == 0


def test_prefix_cache_registers_only_accepted_tokens(tiny_model_dir, hf_model):
    # After a speculating request finished, a second one with the same prompt + the first's
    # output must get the same continuation: any block cached from rejected proposals would
    # serve the wrong K/V and change it.
    prompt = repetitive_prompts(1, 267, seed=8)[0]
    engine = make_engine(tiny_model_dir, block_size=4, speculative_method="ngram", num_speculative_tokens=5,
                         speculative_adaptive=False)
    engine.add_request("a", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    first = run_checked(engine)["a"].outputs[0].token_ids
    follow = prompt + first
    engine.add_request("b", follow, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    second = run_checked(engine)["b"]
    assert engine.stats().prefix_cache_hits > 0
    assert second.outputs[0].token_ids == hf_greedy(hf_model, follow, 16)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_distribution_matches_the_target(tiny_model_dir, hf_model, draft_models, method):
    """Engine level: with speculation forced (k=1), the second token of every sample comes out of
    a verification: n-gram proposals (point masses) or a noisy draft's samples (the min(1, p/q)
    rule). Over 4000 samples its distribution must be the target's: the sum over t1 of
    p(t1 | prompt) p(t2 | prompt, t1), with temperature and top-k applied."""
    # Every token occurs in the prompt, so whatever t1 is, n-gram lookup proposes a t2; the
    # model's own greedy text follows, which loops, so its likely tokens recur and get accepted.
    vocab = hf_model.config.vocab_size
    start = random.Random(0).sample(range(vocab), vocab)
    prompt = start + hf_greedy(hf_model, start, 30)
    # The random model's logits are nearly flat: a low temperature makes its choices confident
    # enough that about half the proposals are accepted.
    temperature, top_k = 0.03, 12
    params = SamplingParams(n=200, max_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True)
    spec = dict(speculative_method="draft", draft_model=str(draft_models["noisy"])) if method == "draft" else \
        dict(speculative_method="ngram")
    engine = make_engine(tiny_model_dir, max_num_seqs=200, max_num_batched_tokens=10_000, num_threads=1,
                         num_speculative_tokens=1, speculative_adaptive=False, **spec)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))  # the samples then share its cached blocks
    run_to_completion(engine, check=False)
    for r in range(20):
        engine.add_request(str(r), prompt, params)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for out in run_to_completion(engine, check=False).values():
        for o in out.outputs:
            counts[o.token_ids[1]] += 1
    stats = engine.stats()
    assert stats.spec_num_proposed_tokens == 4000, "every second token should have been speculated"
    assert 300 < stats.spec_num_accepted_tokens < stats.spec_num_proposed_tokens - 300, \
        "with both outcomes, accept and reject, well represented"

    def probs(logits):
        filtered = filter_logits(logits[None] / temperature, torch.tensor([top_k]), torch.tensor([1.0]),
                                 torch.tensor([0.0]))
        return filtered[0].softmax(-1)

    with torch.inference_mode():
        p1 = probs(hf_model(torch.tensor([prompt])).logits[0, -1])
        support = torch.nonzero(p1).flatten().tolist()
        p2 = torch.stack([probs(row) for row in hf_model(torch.tensor([prompt + [t] for t in support])).logits[:, -1]])
        expected = (p1[support, None] * p2).sum(0).double() * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token the target gives no mass was sampled"
    # Pool the bins expected to hold fewer than 5 samples, as the chi-square test needs.
    small = expected < 5
    obs = counts[~small].tolist() + [float(counts[small].sum())]
    exp = expected[~small].tolist() + [float(expected[small].sum())]
    assert chi_square_p_value(obs, exp) > 1e-3


def test_verify_with_a_bad_draft_gives_the_tiny_models_distribution(hf_model):
    """The issue's statistical test: the tiny model's own next-token distributions (temperature
    and top-k over a small support), a deliberately bad draft (no mass on the target's most
    likely token, most of it on tokens the target excludes), k = 2, 20k verifications through
    verify() in engine-sized batches. Expected frequencies come from transformers' logits and a
    naive top-k softmax, not from the code under test."""
    from tessera.spec.rejection import verify

    temperature, top_k, n = 0.05, 10, 20_000
    params = SamplingParams(temperature=temperature, top_k=top_k)
    prompt = repetitive_prompts(1, hf_model.config.vocab_size, seed=4)[0]

    def reference_probs(logits: torch.Tensor) -> torch.Tensor:
        scaled = logits.double() / temperature
        keep = scaled >= scaled.topk(top_k, dim=-1).values[..., -1:]
        return scaled.masked_fill(~keep, float("-inf")).softmax(-1)

    def last_logits(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            return hf_model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1].float()

    row0 = last_logits([[]])[0]
    p0 = reference_probs(row0)
    ranked = p0.argsort(descending=True).tolist()  # support first, the mode at 0
    support, outside = ranked[:top_k], ranked[top_k:]

    def bad_draft(on_support: list[int], off_support: list[int]) -> torch.Tensor:
        q = torch.zeros_like(p0, dtype=torch.float32)
        q[on_support] = 0.4 / len(on_support)
        q[off_support] = 0.6 / len(off_support)
        return q

    q0 = bad_draft(support[5:], outside[:6])  # nothing on the 5 likeliest tokens
    q1 = bad_draft(support[2:4], outside[10:14])
    torch.manual_seed(7)
    x1 = torch.multinomial(q0, n, replacement=True).tolist()
    x2 = torch.multinomial(q1, n, replacement=True).tolist()
    firsts = sorted(set(x1))
    pairs = sorted(set(zip(x1, x2, strict=True)))
    row1 = dict(zip(firsts, last_logits([[a] for a in firsts]), strict=True))
    row2 = dict(zip(pairs, last_logits([list(pair) for pair in pairs]), strict=True))
    draft = torch.stack([q0, q1])
    first_out, second_out, accepted_first = [], [], 0
    for lo in range(0, n, 500):  # a batch of 500 sequences per verify() call, as a step would
        batch = range(lo, min(lo + 500, n))
        logits = torch.stack([row for i in batch for row in (row0, row1[x1[i]], row2[(x1[i], x2[i])])])
        result = verify(logits, [[x1[i], x2[i]] for i in batch], [params] * len(batch), [0] * len(batch),
                        [None] * len(batch), draft_probs=[draft] * len(batch))
        for i, tokens, m in zip(batch, result.token_ids, result.num_accepted, strict=True):
            assert tokens[:m] == [x1[i], x2[i]][:m] and len(tokens) == m + 1
            first_out.append(tokens[0])
            if m >= 1:
                second_out.append(tokens[1])
                accepted_first += 1

    def p_value(samples: list[int], probs: torch.Tensor) -> float:
        counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
        expected = probs * len(samples)
        assert counts[expected == 0].sum() == 0, "drew a token the target gives no mass"
        small = (expected > 0) & (expected < 5)  # pooled, as the chi-square test needs
        big = expected >= 5
        pooled = [float(counts[small].sum())], [float(expected[small].sum())]
        has_pool = bool(small.any())
        return chi_square_p_value(counts[big].tolist() + pooled[0] * has_pool,
                                  expected[big].tolist() + pooled[1] * has_pool)

    assert p_value(first_out, p0) > 1e-3
    # Given x_1 was accepted (probability min(p0, q0)(x_1) / sum), the second output token is
    # drawn from the target's distribution after x_1, whatever x_2 and q_1 were.
    accept = torch.minimum(p0, q0.double())
    assert abs(accepted_first / n - float(accept.sum())) < 0.015, "acceptance is sum min(p, q), the optimum"
    mixture = sum(accept[a] / accept.sum() * reference_probs(row1[a]) for a in firsts if accept[a] > 0)
    assert len(second_out) > 2000 and p_value(second_out, mixture) > 1e-3
