"""Structured outputs on the default model: masking overhead per decode step, grammar compile time.

For batch 1 and 32: the mean engine step of a decode batch with no constraint, then with every
sequence under a JSON schema (arrays of free strings, the states where most tokens stay allowed
and a mask costs most to fill), and the parts of the constrained step's extra cost timed alone:
filling the packed mask of all rows (xgrammar, on the mask thread) and applying it to the logits
(one batched tensor op). Compile: the first constraint (including the backend's tokenizer
tables), a new schema afterwards, and the same schema again (the cache). Prints a table and
writes JSON (results/structured.json). Run it under /tmp/tools/quiet.

    python benchmarks/structured.py [--steps 30] [--compiled]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from machine import cpu_name  # benchmarks/ is the script's folder

from tessera.config import DEFAULT_MODEL, EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.sampling import SamplingParams
from tessera.structured import StructuredOutputsParams
from tessera.structured.bitmask import apply_bitmask
from tessera.structured.manager import StructuredOutputManager

# minItems keeps every sequence inside the grammar for the whole measurement (the batch must not shrink).
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 100}},
          "required": ["notes"]}
OTHER_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
                "required": ["name", "age"]}


def decode_step_times(engine: LLMEngine, batch: int, constrained: bool, steps: int) -> list[float]:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    for i in range(batch):
        engine.add_request(f"{constrained}-{batch}-{i}", f"Write notes about topic number {i}:",
                           SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True,
                                          structured_outputs=so))
    while engine._awaiting_grammar or any(s.num_output_tokens < 2 for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # prefill and the first tokens: not timed
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if engine.stats().last_step_num_seqs != batch:
            raise RuntimeError(f"the batch shrank to {engine.stats().last_step_num_seqs}: raise max_tokens or minItems")
    engine.abort_request([f"{constrained}-{batch}-{i}" for i in range(batch)])
    return times


def mask_part_times(engine: LLMEngine, batch: int, reps: int = 30) -> tuple[float, float]:
    """(fill, apply) seconds for `batch` rows under SCHEMA, each matcher inside a string."""
    manager = engine.structured
    compiled = manager.compile(StructuredOutputsParams(json=SCHEMA)).result()
    ids = engine.tokenizer.encode('{"notes": ["a b', add_special_tokens=False)
    seq_ids = [-1 - i for i in range(batch)]
    for s in seq_ids:
        manager.add_sequence(s, compiled, ids)
    fills = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mask = manager.fill(seq_ids, {})
        fills.append(time.perf_counter() - t0)
    logits = torch.randn(batch, engine.model_config.vocab_size)
    applies = []
    for _ in range(reps):
        t0 = time.perf_counter()
        apply_bitmask(logits, mask.bitmask, mask.rows)
        applies.append(time.perf_counter() - t0)
    for s in seq_ids:
        manager.forget(s)
    return statistics.median(fills), statistics.median(applies)


def compile_times(engine: LLMEngine) -> dict[str, float]:
    fresh = StructuredOutputManager("xgrammar", engine.tokenizer.hf, engine.model_config.vocab_size,
                                    engine.eos_token_ids)
    t0 = time.perf_counter()
    fresh.compile(StructuredOutputsParams(json=SCHEMA)).result()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh.compile(StructuredOutputsParams(json=OTHER_SCHEMA)).result()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        fresh.compile(StructuredOutputsParams(json=OTHER_SCHEMA)).result()
    cached = (time.perf_counter() - t0) / 100
    t0 = time.perf_counter()
    fresh.compile(StructuredOutputsParams(regex=r"[A-Z][a-z]{2,12} [0-9]{1,4}")).result()
    regex = time.perf_counter() - t0
    fresh.shutdown()
    return {"first_with_backend_s": first, "json_schema_cold_s": cold, "json_schema_cached_s": cached,
            "regex_cold_s": regex}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--compiled", action="store_true", help="the compiled model step (default: eager)")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "structured.json"))
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, num_threads=args.num_threads,
                                    enforce_eager=not args.compiled, max_num_seqs=32, max_num_batched_tokens=1024))
    result: dict = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "compiled": args.compiled,
                    "model": DEFAULT_MODEL, "dtype": str(engine.dtype), "batches": {}}
    result["compile"] = compile_times(engine)
    for batch in (1, 32):
        plain = statistics.median(decode_step_times(engine, batch, False, args.steps))
        constrained = statistics.median(decode_step_times(engine, batch, True, args.steps))
        fill, apply = mask_part_times(engine, batch)
        result["batches"][batch] = {"plain_step_s": plain, "constrained_step_s": constrained,
                                    "step_overhead": constrained / plain - 1, "fill_s": fill, "apply_s": apply,
                                    "fill_plus_apply_of_step": (fill + apply) / plain}
    print(f"structured outputs, {DEFAULT_MODEL} ({result['dtype']}, {'compiled' if args.compiled else 'eager'}), "
          f"{result['threads']} threads, {result['cpu']}")
    print(f"{'batch':>5} {'plain ms':>9} {'json ms':>9} {'overhead':>9} {'fill ms':>8} {'apply ms':>9} {'(f+a)/step':>11}")
    for batch, r in result["batches"].items():
        print(f"{batch:>5} {r['plain_step_s'] * 1e3:>9.2f} {r['constrained_step_s'] * 1e3:>9.2f} "
              f"{r['step_overhead'] * 100:>8.1f}% {r['fill_s'] * 1e3:>8.3f} {r['apply_s'] * 1e3:>9.3f} "
              f"{r['fill_plus_apply_of_step'] * 100:>10.1f}%")
    c = result["compile"]
    print(f"compile: first (with tokenizer tables) {c['first_with_backend_s'] * 1e3:.0f} ms, new JSON schema "
          f"{c['json_schema_cold_s'] * 1e3:.1f} ms, cached {c['json_schema_cached_s'] * 1e6:.1f} us, "
          f"regex {c['regex_cold_s'] * 1e3:.1f} ms")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
