"""Structured outputs in the engine, on the tiny random model: every output follows its
constraint (checked with jsonschema and Python's re, not with the grammar library itself),
under continuous batching, prefix caching, n > 1, seeds, preemption and n-gram speculation.

Validity is a property of the mask, so a random model is as good a test subject as a trained
one (better: it tries every path). Whitespace is disabled so that outputs stay short.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from tessera import SamplingParams
from tessera.structured import StructuredOutputsParams
from tessera.structured.bitmask import apply_bitmask
from tests.unit.test_engine import make_engine
from tests.unit.test_spec_decode import run_checked

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                     "city": {"enum": ["Paris", "Rome"]}},
                    "required": ["zip", "city"]}},
        "required": ["name", "address"]},
    "array_bounds": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"]},
    "enum_anyof": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", 3, None]},
        "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "boolean"},
                            {"type": "string", "pattern": "^x{1,4}$"}]}},
        "required": ["kind", "value"]},
    "numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
        "required": ["age", "score", "items"]},
    "pattern": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                                 "ok": {"type": "boolean"}},
                "required": ["id", "ok"]},
}
MAX_TOKENS = 120


def json_params(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True), **kw)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, max_num_seqs=64, max_num_batched_tokens=1024)


def test_params_are_checked():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    a = StructuredOutputsParams(json={"b": 1, "a": {"type": "string"}})
    b = StructuredOutputsParams(json='{"a": {"type": "string"}, "b": 1}')
    assert a.cache_key() == b.cache_key()


@pytest.mark.parametrize("rows", [None, [0, 2]])
def test_apply_bitmask_matches_bit_by_bit_reference(rows):
    torch.manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(3, vocab)
    nrows = 3 if rows is None else len(rows)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (nrows, 3), dtype=torch.int32)
    expected = logits.clone()
    for i, r in enumerate(range(3) if rows is None else rows):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    got = apply_bitmask(logits, bitmask, None if rows is None else torch.tensor(rows))
    assert torch.equal(got, expected)
    assert not torch.isinf(logits).any(), "the caller's logits must not be written"


def test_schema_suite_200_concurrent_requests_all_validate(engine):
    # 5 schemas x (greedy + sampled with several seeds and n=2) = 200 sequences in one batch run.
    requests = []
    for name, schema in SCHEMAS.items():
        requests.append((name, json_params(schema, temperature=0.0)))
        for seed in range(19):
            requests.append((name, json_params(schema, temperature=1.0, seed=seed, n=2)))
        requests.append((name, json_params(schema, temperature=0.7, top_p=0.9)))
    for i, (_, params) in enumerate(requests):
        engine.add_request(f"s{i}", f"Answer {i} in JSON:", params)
    results = run_checked(engine)
    count = 0
    for i, (name, _) in enumerate(requests):
        for c in results[f"s{i}"].outputs:
            assert c.finish_reason == "stop", (name, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
            count += 1
    assert count == 200


def test_regex_choice_grammar_and_json_object(engine):
    cases = [
        (StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{1,3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-\d{1,3}", t)),
        (StructuredOutputsParams(regex=r"(yes|no)( because [a-c]{1,4})?"),
         lambda t: re.fullmatch(r"(yes|no)( because [a-c]{1,4})?", t)),
        (StructuredOutputsParams(choice=["positive", "negative", "the weather"]),
         lambda t: t in ("positive", "negative", "the weather")),
        (StructuredOutputsParams(grammar='root ::= "(" num ("+" num){0,4} ")"\nnum ::= [1-9]'),
         lambda t: re.fullmatch(r"\([1-9](\+[1-9]){0,4}\)", t)),
        (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
         lambda t: isinstance(json.loads(t), dict)),
    ]
    rid = 0
    expected = {}
    unbounded = set()  # any JSON object: a random model may nest until max_tokens
    for constraint, check in cases:
        for params in (SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=constraint),
                       SamplingParams(max_tokens=200, temperature=1.0, seed=3, n=6, structured_outputs=constraint)):
            engine.add_request(f"r{rid}", "Say it:", params)
            expected[f"r{rid}"] = check
            if constraint.json_object:
                unbounded.add(f"r{rid}")
            rid += 1
    results = run_checked(engine)
    for r, check in expected.items():
        for c in results[r].outputs:
            if c.finish_reason == "length" and r in unbounded:
                continue
            assert c.finish_reason == "stop" and check(c.text), (r, c.text)
    assert sum(c.finish_reason == "stop" for r in unbounded for c in results[r].outputs) >= 2


def test_stop_strings_and_unsatisfiable_length(engine):
    engine.add_request("len", "x", SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
        regex="a{40}")))
    engine.add_request("stop", "x", SamplingParams(max_tokens=50, stop=["-"], structured_outputs=StructuredOutputsParams(
        regex=r"ab-cd")))
    results = run_checked(engine)
    assert results["len"].outputs[0].finish_reason == "length"
    assert results["len"].outputs[0].text == "aaaaa"
    assert results["stop"].outputs[0].finish_reason == "stop" and results["stop"].outputs[0].text == "ab"


def test_bad_constraints_are_refused_and_hold_nothing(tiny_model_dir):
    from tessera.engine.llm import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32")
    for constraint, message in ((StructuredOutputsParams(regex="(ab"), "regex.*parenthesis"),
                                (StructuredOutputsParams(json={"type": "nope"}), "json.*nope"),
                                (StructuredOutputsParams(grammar="root ::= missing"), "grammar.*missing")):
        with pytest.raises(ValueError, match=message):
            llm.generate("hi", SamplingParams(structured_outputs=constraint), use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0
    # The engine refuses a known-bad constraint at add_request too (the compile is cached).
    with pytest.raises(ValueError, match="regex"):
        engine.add_request("x", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab")))
    assert not engine.has_unfinished_requests()


def test_compiles_are_cached_by_constraint(engine):
    manager = engine.structured
    schema = {"type": "object", "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["q"]}
    first = manager.compile(StructuredOutputsParams(json=schema))
    first.result()
    again = manager.compile(StructuredOutputsParams(json=json.dumps(schema)))
    assert again is first


def test_speculative_masks_follow_the_grammar_after_each_proposal(engine):
    """fill() for a speculating row set: row j equals the mask of a fresh matcher advanced by
    the first j proposals (xgrammar directly), up to the first proposal the grammar refuses."""
    manager = engine.structured
    constraint = StructuredOutputsParams(regex=r"ab(c|d)+e")
    compiled = manager.compile(constraint).result()
    tok = engine.tokenizer
    ids = {ch: tok.encode(ch, add_special_tokens=False)[0] for ch in "abcde"}
    manager.add_sequence(-1, compiled)
    proposal = [ids["a"], ids["b"], ids["c"], ids["a"], ids["e"]]  # "a" breaks the grammar at position 3
    mask = manager.fill([-1] * (len(proposal) + 1), {-1: proposal})
    manager.forget(-1)
    assert mask.rows is None and mask.bitmask.shape[0] == len(proposal) + 1
    for j in range(4):
        ref = xgr.GrammarMatcher(compiled)
        for t in proposal[:j]:
            assert ref.accept_token(t)
        want = xgr.allocate_token_bitmask(1, engine.model_config.vocab_size)
        ref.fill_next_token_bitmask(want)
        assert torch.equal(mask.bitmask[j], want[0]), f"row {j}"
    # The matcher was rolled back: a fresh fill at the start equals row 0.
    manager.add_sequence(-2, compiled)
    assert torch.equal(manager.fill([-2], {}).bitmask[0], mask.bitmask[0])
    manager.forget(-2)


def test_a_cpu_engine_fills_masks_at_once_and_the_same_as_the_worker(engine, monkeypatch):
    """On the CPU the model step's threads hold every core, so the engine fills a step's masks in
    its own thread before the step (done on return), the same bits the mask thread gives."""
    manager = engine.structured
    assert engine.runner.device.type == "cpu" and manager.fill_on_worker is False
    compiled = manager.compile(StructuredOutputsParams(regex=r"ab(c|d)+e")).result()
    manager.add_sequence(-3, compiled)
    try:
        at_once = manager.fill_async([-3, 7], None)  # seq 7 has no matcher: its row stays free
        assert at_once.done()
        monkeypatch.setattr(manager, "fill_on_worker", True)
        worker = manager.fill_async([-3, 7], None).result()
    finally:
        manager.forget(-3)
    assert torch.equal(at_once.result().bitmask, worker.bitmask) and torch.equal(at_once.result().rows, worker.rows)


@pytest.mark.parametrize("sampled", [False, True])
def test_ngram_speculation_with_constraints_gives_the_same_tokens(tiny_model_dir, sampled):
    # Arrays of objects repeat their keys, so n-gram lookup proposes tokens the grammar forces.
    schema = {"type": "array", "minItems": 3, "maxItems": 5, "items": {
        "type": "object", "properties": {"alpha": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "beta": {"enum": ["on", "off"]}}, "required": ["alpha", "beta"]}}
    constraints = [StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                   StructuredOutputsParams(regex=r"(abc,){3,6}x"),
                   StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
                                               "required": ["name"]}, disable_any_whitespace=True)]
    outputs, stats = [], None
    for kw in ({}, dict(speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False)):
        engine = make_engine(tiny_model_dir, block_size=4, kv_cache_memory=60 * 4 * 512, max_num_seqs=8, **kw)
        for i in range(8):
            extra = dict(temperature=0.8, top_k=20, seed=50 + i) if sampled else dict(temperature=0.0)
            engine.add_request(str(i), f"Data {i}:", SamplingParams(
                max_tokens=200, structured_outputs=constraints[i % len(constraints)], **extra))
        outputs.append({rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason) for rid, o in run_checked(engine).items()})
        stats = engine.stats()
    assert outputs[0] == outputs[1]
    assert stats.spec_num_accepted_tokens > 10, "the constraints are meant to get proposals accepted"
    for rid, (_, reason) in outputs[1].items():
        assert reason == "stop", rid
