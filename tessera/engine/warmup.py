"""Warm-up: run the engine's own steps on throw-away requests before it serves anyone.

The first step at a new shape pays for things later steps do not: oneDNN/AMX kernel plans made
per GEMM shape, the allocator growing its pools, the native kernels' first calls, the
tokenizer's first decodes. Without a warm-up the first clients after a start see that as a
slow first token. `warm_up` runs a prefill and a few decode steps at every batch size in
`decode_batch_sizes` (powers of two up to max_num_seqs, and max_num_seqs itself) and one prefill
of a full step's token budget, through `add_request`/`step` like any request, then puts every
counter a user can see back where it was (token totals, preemptions, the last step's figures).
The prefix cache is off while it runs, so its blocks go back to the pool anonymous: the cache
and its hit/eviction figures are those of a fresh engine.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from tessera.sampling import SamplingParams

if TYPE_CHECKING:
    from tessera.engine.engine import LLMEngine

logger = logging.getLogger("tessera")

_PROMPT_LEN = 16  # tokens per warm-up decode request: short, so the warm-up takes little time
_DECODE_STEPS = 3


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two up to max_num_seqs, and max_num_seqs itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def warm_up(engine: LLMEngine, batch_sizes: list[int] | None = None) -> float:
    """Run the warm-up (see the module doc) on an idle engine; returns its seconds."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine: it would mix its requests with real ones")
    started = time.perf_counter()
    saved = _counters(engine)
    caching, engine.kv.enable_prefix_caching = engine.kv.enable_prefix_caching, False
    try:
        sizes, long_len = _steps(engine, batch_sizes)
    finally:
        engine.kv.enable_prefix_caching = caching
        _restore(engine, saved)
    seconds = time.perf_counter() - started
    logger.info("warmed up in %.1fs: decode batch sizes %s, prefill of %d tokens", seconds, sizes, long_len)
    return seconds


def _steps(engine: LLMEngine, batch_sizes: list[int] | None) -> tuple[list[int], int]:
    sched = engine.scheduler
    sizes = batch_sizes or decode_batch_sizes(sched.max_num_seqs)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    lo, hi = min(100, vocab // 4), max(vocab - 100, vocab * 3 // 4)
    prompt_len = max(1, min(_PROMPT_LEN, engine.max_model_len - _DECODE_STEPS - 1))
    params = SamplingParams(temperature=0.0, max_tokens=_DECODE_STEPS, ignore_eos=True)
    for batch in sizes:
        batch = min(batch, sched.max_num_seqs, max(1, sched.max_num_batched_tokens // prompt_len))
        for i in range(batch):
            engine.add_request(f"warmup-{batch}-{i}", [rng.randrange(lo, hi) for _ in range(prompt_len)], params)
        _run(engine)
    # One prefill as large as a step allows (capped by the context), for the largest GEMMs.
    long_len = min(sched.max_num_batched_tokens, engine.max_model_len - 2)
    if long_len > prompt_len:
        try:
            engine.add_request("warmup-prefill", [rng.randrange(lo, hi) for _ in range(long_len)],
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        except ValueError:  # a KV pool smaller than one full step: nobody will send such a prefill
            return sizes, 0
        _run(engine)
    return sizes, long_len


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _counters(engine: LLMEngine) -> dict[str, int]:
    sched = engine.scheduler
    return dict(prompt=engine._prompt_tokens_total, generation=engine._generation_tokens_total,
                preemptions=sched.num_preemptions)


def _restore(engine: LLMEngine, saved: dict[str, int]) -> None:
    sched = engine.scheduler
    engine._prompt_tokens_total, engine._generation_tokens_total = saved["prompt"], saved["generation"]
    sched.num_preemptions = saved["preemptions"]
    engine._last_step, engine._last_step_time = (0, 0), 0.0
