"""StructuredOutputManager: the engine's side of structured outputs.

- compile(params) hands the constraint to a worker thread and returns a Future; compiled
  grammars (and compile errors) are cached by the constraint's cache key, LRU, so a schema sent
  again is ready at once. The step loop never waits for a compile: the engine keeps a request
  out of the scheduler until its Future is done.
- One matcher per constrained sequence (n > 1 gives each sample its own), advanced by accept()
  as the engine appends tokens; a preempted sequence keeps its tokens and so its matcher.
- fill_async(rows) writes the next-token masks of a step's constrained rows into one packed
  bitmask on a worker thread, while the model step runs (on a GPU; with the step on the CPU it
  fills at once, in the caller's thread: `fill_on_worker`). A speculating sequence owns k+1 rows:
  row j is masked with the grammar state after its first j proposals, found by walking the
  proposals through the matcher and rolling it back afterwards. Once a proposal breaks the
  grammar the rest of its rows repeat the last mask: verification rejects that proposal at the
  row before it, so later rows are never read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tessera.structured.backend import (
    STRUCTURED_OUTPUT_BACKENDS,
    GrammarMatcher,
    StructuredOutputBackend,
    create_backend,
)
from tessera.structured.bitmask import TokenMask, allocate_bitmask
from tessera.structured.params import StructuredOutputsParams

logger = logging.getLogger("tessera")


@dataclass
class StructuredStats:
    num_compiles: int = 0
    num_cache_hits: int = 0
    compile_time_s: float = 0.0


class StructuredOutputManager:
    def __init__(self, backend: str, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_cached_grammars: int = 512) -> None:
        if backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"--structured-outputs-backend {backend!r}: choose one of "
                             f"{', '.join(STRUCTURED_OUTPUT_BACKENDS)}")
        self.backend_name = backend
        self.vocab_size = vocab_size
        self._hf_tokenizer = hf_tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._backend: StructuredOutputBackend | None = None  # built on first use: xgrammar takes seconds to import
        self._backend_lock = threading.Lock()
        self._lock = threading.Lock()  # compile() is called from the server's and the engine's threads
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._max_cached = max_cached_grammars
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-grammar")
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-mask")
        self._matchers: dict[int, GrammarMatcher] = {}
        self.stats = StructuredStats()
        # Whether fill_async fills on the mask thread, overlapping the model step. The engine turns
        # it off when the step runs on the CPU: there the step's OpenMP team holds every core, and a
        # Python thread beside it made the step wait for the GIL (a 32-row decode step 30 -> 37 ms
        # on 2 cores, for a 0.4 ms fill).
        self.fill_on_worker = True

    # ---- compiling (any thread) -------------------------------------------------------------

    def backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = create_backend(self.backend_name, self._hf_tokenizer, self.vocab_size,
                                               self._stop_token_ids)
            return self._backend

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params`, as a Future (failing with ValueError if invalid)."""
        key = params.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                return future
            future = self._compile_pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        started = time.perf_counter()
        try:
            return self.backend().compile(params)
        finally:
            self.stats.num_compiles += 1
            self.stats.compile_time_s += time.perf_counter() - started

    # ---- matchers (engine thread) -----------------------------------------------------------

    def add_sequence(self, seq_id: int, compiled: Any, output_token_ids: Sequence[int] = ()) -> None:
        """Start a matcher for a sequence, advanced over the output it already has (an import)."""
        matcher = self.backend().new_matcher(compiled)
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                raise ValueError(f"output token {token_id} breaks the request's structured_outputs constraint")
        self._matchers[seq_id] = matcher

    def is_constrained(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Advance a sequence's matcher; False when the sequence must stop here: the grammar is
        complete, or the token was refused (possible only when min_tokens held back the stop
        token that was the grammar's one way on)."""
        matcher = self._matchers[seq_id]
        if not matcher.accept_token(token_id):
            logger.warning("sequence %d: token %d is outside its grammar; stopping it", seq_id, token_id)
            return False
        return not matcher.is_terminated()

    def forget(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    # ---- masks (engine thread hands work to the mask thread) --------------------------------

    def fill_async(self, row_seq_ids: Sequence[int], spec_tokens: dict[int, list[int]] | None) -> Future | None:
        """Start filling the masks of a step whose logits rows belong to `row_seq_ids` (a
        speculating sequence's id repeats over its k+1 rows); None if no row is constrained."""
        if not any(s in self._matchers for s in row_seq_ids):
            return None
        if not self.fill_on_worker:
            done: Future = Future()
            done.set_result(self.fill(list(row_seq_ids), spec_tokens or {}))
            return done
        return self._fill_pool.submit(self.fill, list(row_seq_ids), spec_tokens or {})

    def fill(self, row_seq_ids: Sequence[int], spec_tokens: dict[int, list[int]]) -> TokenMask | None:
        entries: list[tuple[GrammarMatcher, int, list[int]]] = []  # matcher, first row, proposal
        row = 0
        while row < len(row_seq_ids):
            seq_id = row_seq_ids[row]
            proposal = spec_tokens.get(seq_id) or []
            matcher = self._matchers.get(seq_id)
            if matcher is not None:
                entries.append((matcher, row, proposal))
            row += len(proposal) + 1
        if not entries:
            return None
        rows = [r for _, start, proposal in entries for r in range(start, start + len(proposal) + 1)]
        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        i = 0
        for matcher, _, proposal in entries:
            accepted = 0
            live = True
            for j in range(len(proposal) + 1):
                if live:
                    matcher.fill_bitmask(bitmask, i + j)
                else:
                    bitmask[i + j] = bitmask[i + j - 1]
                if live and j < len(proposal):
                    live = matcher.accept_token(proposal[j])
                    if live:
                        accepted += 1
                        live = not matcher.is_terminated()
            matcher.rollback(accepted)
            i += len(proposal) + 1
        index = None if len(rows) == len(row_seq_ids) else torch.tensor(rows)
        return TokenMask(bitmask, index)

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
