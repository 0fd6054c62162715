"""LLMEngine: the step loop that ties scheduler, KV cache, model runner and sampler together.

One `step()` = the scheduler picks which sequences run and how many tokens each computes, the
model runner runs them in one forward pass, the sampler picks the next tokens, and the engine
appends them, checks stop conditions, frees finished sequences' blocks at once and returns
per-request output deltas. Front ends (LLM, AsyncLLMEngine) only call the public methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from tessera.config import EngineConfig, resolve_dtype
from tessera.engine.handoff import SequenceHandoff, kv_nbytes, read_kv, write_kv
from tessera.engine.kv_cache import KVCacheManager
from tessera.engine.kv_sizing import num_kv_blocks
from tessera.engine.model_runner import ModelRunner, prepare_step_kernels
from tessera.engine.openmp_team import release_calling_thread_team
from tessera.engine.output_processor import SequenceTextState, decode_logprobs
from tessera.engine.request import Sequence, SequenceStatus
from tessera.engine.sampler import Sampler
from tessera.engine.scheduler import Scheduler
from tessera.engine.swap import HostBlockPool, PreemptionPolicy, measure_swap_costs, num_host_kv_blocks
from tessera.model.base import kv_window
from tessera.model.download import resolve_model_path
from tessera.model.registry import build_model
from tessera.model.tokenizer import Tokenizer
from tessera.model.weights import load_model_files
from tessera.outputs import RequestMetrics, RequestOutput
from tessera.quant.kv import kv_bytes_per_token
from tessera.sampling import RequestOutputKind, SamplingParams
from tessera.spec.decoder import SpeculativeDecoder
from tessera.structured.manager import StructuredOutputManager

logger = logging.getLogger("tessera")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    last_step_num_seqs: int
    last_step_num_tokens: int
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # of those, tokens whose KV blocks came from the prefix cache
    prefix_cache_hit_rate: float = 0.0  # hits / queries, by tokens
    last_step_time_s: float = 0.0  # wall time of the last step (schedule, forward, sample, detokenize)
    num_evicted_blocks: int = 0  # cached blocks whose contents were overwritten
    num_swapped_out_blocks: int = 0  # blocks copied to the host pool by swap preemptions
    num_swapped_in_blocks: int = 0  # blocks copied back from the host pool
    num_swapped_seqs: int = 0  # sequences whose KV sits in the host pool now
    num_host_free_blocks: int = 0
    num_host_total_blocks: int = 0
    num_demoted_blocks: int = 0  # evicted cached blocks copied to the host tier instead of dropped
    num_promoted_blocks: int = 0  # of those, copied back for a prefix hit instead of recomputed
    num_host_cached_blocks: int = 0  # demoted blocks in the host tier now
    # Speculative decoding (all 0 when it is off): proposed and accepted tokens, accepted per
    # verification, and decode steps (and their seconds) with speculation on and off.
    spec_num_proposed_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_num_steps_on: int = 0
    spec_num_steps_off: int = 0
    spec_time_on_s: float = 0.0
    spec_time_off_s: float = 0.0


class _RequestState:
    """A user request: its n sequences and what has been reported about them."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.texts: list[SequenceTextState] = []
        self.handoff = False  # leaves this engine after its first token (prefill/decode disaggregation)

    @property
    def finished(self) -> bool:
        return all(t.seq.is_finished for t in self.texts)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.model_path = path = resolve_model_path(config.model)
        files = load_model_files(path)
        self.model_config = mc = files.config
        self.max_model_len = config.resolve_max_model_len(mc)  # refused before the weights load
        self.dtype = resolve_dtype(config.dtype)
        t0 = time.perf_counter()
        model = build_model(files, self.dtype, config.device, config.attention_backend, config.quantization,
                            config.quantize_lm_head, config.quant_group_size, config.sparsity)
        prepare_step_kernels(model, config, self.dtype, files)
        self.tokenizer = Tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer else path, mc,
                                   chat_template=config.chat_template)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        num_blocks = num_kv_blocks(config, mc, self.dtype, self.max_model_len)
        num_host_blocks = num_host_kv_blocks(config.swap_space, config.block_size,
                                             kv_bytes_per_token(mc, self.dtype, config.kv_cache_dtype))
        self.runner = ModelRunner(model, num_blocks, config.block_size, num_host_blocks, config.kv_cache_dtype)
        if self.runner.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_decode_graphs(self.max_model_len, config.max_num_seqs)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.host_pool = HostBlockPool(num_host_blocks, config.block_size) if num_host_blocks else None
        mode = config.preemption_mode if num_host_blocks else "recompute"
        costs = measure_swap_costs(self.runner, num_blocks - 1, num_host_blocks) if mode == "auto" else None
        if costs is not None:
            logger.info("host KV tier: %d blocks; swap round trip %.0f us + %.1f us/block, prefill %.0f us/token",
                        num_host_blocks, costs.roundtrip_overhead_s * 1e6, costs.roundtrip_per_block_s * 1e6,
                        costs.prefill_per_token_s * 1e6)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            kv=self.kv,
            host=self.host_pool,
            preemption=PreemptionPolicy(mode, costs),
            sliding_window=kv_window(model.kv_layout()),
        )
        self.sampler = Sampler()
        self.spec = SpeculativeDecoder.from_config(config, self.kv, self.max_model_len, num_blocks, self.dtype,
                                                   mc.vocab_size) if config.speculative_method else None
        self._spec_parked: SpeculativeDecoder | None = None  # set_speculation(None) keeps it here
        # Structured outputs: grammars compile on a worker thread; a constrained request waits
        # here (outside the scheduler) until its grammar is ready, never the step.
        self.structured = StructuredOutputManager(config.structured_outputs_backend, self.tokenizer.hf,
                                                  mc.vocab_size, self.eos_token_ids)
        # A CPU step holds every core: masks are filled before it, not beside it (manager.fill_on_worker).
        self.structured.fill_on_worker = self.runner.device.type != "cpu"
        self._awaiting_grammar: list[tuple[list[Sequence], Future]] = []
        self._requests: dict[str, _RequestState] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._last_step = (0, 0)
        self._last_step_time = 0.0
        # Disaggregation (tessera.engine.handoff): finished prefills waiting to be taken, imports
        # waiting for room in the batch or the pool, and where exported K/V are written (a
        # transport may hand out shared memory here to save a copy).
        self._handoffs: dict[str, tuple[SequenceHandoff, torch.Tensor]] = {}
        self._pending_imports: list[tuple[SequenceHandoff, torch.Tensor | None]] = []
        self.kv_export_alloc = lambda shape, dtype: torch.empty(shape, dtype=dtype)
        logger.info(
            "loaded %s (%s, %s) in %.1fs; KV cache: %d blocks x %d tokens = %d tokens; max_model_len %d",
            path.name, mc.architecture, str(self.dtype).removeprefix("torch."), time.perf_counter() - t0,
            num_blocks - 1, config.block_size, (num_blocks - 1) * config.block_size, self.max_model_len,
        )
        # Loading ran OpenMP regions on this thread; if another thread steps the engine (a web
        # app's worker thread), this thread's team would make every worker sleep between regions
        # (tessera.engine.openmp_team). Stepping here instead only starts a team again, once.
        release_calling_thread_team()

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, handoff: bool = False) -> None:
        """handoff: stop after the first token and keep the prompt's K/V for `take_handoff`,
        unless that token already ends the request (n must be 1)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if handoff and params.n != 1:
            raise ValueError(f"a handed-off request must have n=1, got n={params.n}")
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_text, prompt_ids = None, list(prompt)
        self._validate_prompt(prompt_ids, params)
        state = _RequestState(request_id, prompt_text, prompt_ids, params,
                              arrival_time if arrival_time is not None else time.monotonic())
        seqs = [Sequence(request_id, prompt_ids, params, index=i, arrival_time=state.metrics.arrival_time)
                for i in range(params.n)]
        # Everything that can fail happens before the scheduler holds a sequence: a sequence queued
        # without its request state would crash the next step.
        generators = {}
        if params.seed is not None:
            # Each of the n samples gets its own stream; the same seed repeats the same outputs.
            generators = {seq.seq_id: torch.Generator().manual_seed(params.seed + 1_000_003 * seq.index)
                          for seq in seqs}
        grammar = self._grammar_future(params)
        for seq in seqs:  # the n share prompt and params: all fit the KV pool, or the first raises
            if grammar is None:
                self.scheduler.add(seq)  # raises ValueError if it can never fit the KV pool
            else:
                self.scheduler._check_fits(seq)
            state.texts.append(SequenceTextState(seq, self.tokenizer))
        if grammar is not None:
            self._awaiting_grammar.append((seqs, grammar))
        self._generators.update(generators)
        state.handoff = handoff
        self._requests[request_id] = state
        self._prompt_tokens_total += len(prompt_ids)

    def _grammar_future(self, params: SamplingParams) -> Future | None:
        """The compile of the request's constraint (None if it has none); raises ValueError at
        once if it is already known not to compile."""
        if params.structured_outputs is None:
            return None
        future = self.structured.compile(params.structured_outputs)
        if future.done() and future.exception() is not None:
            raise ValueError(str(future.exception()))
        return future

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand the requests whose grammar is ready to the scheduler; end those whose grammar
        failed to compile (a front end that awaited the compile first never sees this)."""
        failed: dict[str, _RequestState] = {}
        still = []
        for seqs, future in self._awaiting_grammar:
            if not future.done():
                still.append((seqs, future))
                continue
            state = self._requests.get(seqs[0].request_id)
            if state is None:
                continue  # aborted while it waited
            if future.exception() is not None:
                logger.warning("request %s: %s", seqs[0].request_id, future.exception())
                for seq in seqs:
                    seq.status = SequenceStatus.FINISHED_ABORTED
                failed[seqs[0].request_id] = state
                continue
            for seq in seqs:
                self.structured.add_sequence(seq.seq_id, future.result())
                self.scheduler.add(seq)
        self._awaiting_grammar = still
        return self._request_outputs(failed, time.monotonic()) if failed else []

    def _validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of the vocabulary (0..{vocab - 1})")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} is more than this server's limit of "
                             f"{self.config.max_logprobs} (--max-logprobs)")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is {self.max_model_len} "
                f"tokens (prompt plus at least one output token); shorten the prompt or raise --max-model-len"
            )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self._requests.pop(rid, None)
            self._handoffs.pop(rid, None)
            if state is None:
                continue
            self._awaiting_grammar = [(seqs, f) for seqs, f in self._awaiting_grammar if seqs[0].request_id != rid]
            for seq, _ in self._pending_imports:
                if seq.request_id == rid:
                    seq.status = SequenceStatus.FINISHED_ABORTED  # _admit_imports drops it
            for seq in self.scheduler.abort(rid):
                self._generators.pop(seq.seq_id, None)
                self.structured.forget(seq.seq_id)
                if self.spec is not None:
                    self.spec.forget(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs = self._admit_compiled() if self._awaiting_grammar else []
        outputs += self._step(started)
        self._last_step_time = time.perf_counter() - started
        if self._awaiting_grammar and self._last_step == (0, 0) and not outputs:
            # Nothing runs but grammars are compiling: wait for one rather than spin.
            wait([f for _, f in self._awaiting_grammar], timeout=0.05, return_when=FIRST_COMPLETED)
        return outputs

    def _step(self, started: float) -> list[RequestOutput]:
        if self._pending_imports:
            self._admit_imports()
        # A handoff sequence leaves after its first token: speculating for it here would draw
        # tokens (and a seeded request's noise keys) that the handoff does not carry.
        lookahead = None
        if self.spec is not None:
            lookahead = self.spec.plan([s for s in self.scheduler.running if not self._requests[s.request_id].handoff])
        out = self.scheduler.schedule(lookahead)
        self.runner.swap_blocks(out.swap_out, out.swap_in)  # before anything writes the freed blocks
        scheduled = [(s.seq, s.num_new_tokens) for s in out.scheduled]
        if not scheduled:
            self._last_step = (0, 0)
            return []
        now = time.monotonic()
        for seq, _ in scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        spec_tokens = self.spec.propose(out.scheduled) if lookahead else None
        num_decodes = 0
        for seq, n in scheduled:
            if n != 1 or seq.num_computed_tokens != seq.num_tokens - 1 or (spec_tokens and seq.seq_id in spec_tokens):
                break
            num_decodes += 1
        step = self.runner.prepare(scheduled, num_decodes, spec_tokens)
        # Grammar masks: filled on a worker thread while a GPU step runs, at once before a CPU one.
        mask_future = self.structured.fill_async([s.seq_id for s in step.sample_seqs], spec_tokens)
        # The lm_head's kernel finds each row's argmax on the way where a row samples greedily
        # (not for a speculative step: verification compares its own rows).
        wants_argmax = not spec_tokens and any(s.sampling_params.is_greedy for s in step.sample_seqs)
        # Where those ids are the whole sample, the kernel need not store the logits either (6 MiB
        # of fp32 at 32 rows of a 49k vocabulary, a quarter of that lm_head's time).
        ids_only = wants_argmax and mask_future is None and self.sampler.takes_argmax(
            [s.sampling_params for s in step.sample_seqs], [s.output_token_ids for s in step.sample_seqs])
        logits, argmax = self.runner.execute_argmax(step, wants_argmax, logits=not ids_only)
        token_mask = mask_future.result() if mask_future is not None else None
        self.scheduler.update_after_step(out)
        self._last_step = (len(scheduled), step.metadata.num_tokens)
        if not step.sample_seqs:
            return []
        if spec_tokens:
            seqs, token_ids, logprobs = self.spec.sample(step.sample_seqs, logits, spec_tokens, self.sampler,
                                                         self._generators, self.eos_token_ids, token_mask)
            outputs = self._process_samples(seqs, token_ids, logprobs, time.monotonic())
            self.spec.rollback()  # the accepted tokens are appended: trim what was rejected
            self.spec.record_step(out.scheduled, time.perf_counter() - started)
            return outputs
        seqs = step.sample_seqs
        sampled = self.sampler.sample(  # with ids_only, the kernel's ids (Sampler.takes_argmax)
            logits,
            [s.sampling_params for s in seqs],
            [s.output_token_ids for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [self._generators.get(s.seq_id) for s in seqs],
            eos_token_ids=self.eos_token_ids,
            token_mask=token_mask,
            argmax=argmax,
            chunk_maxima=None if argmax is not None else self.runner.chunk_maxima(logits),
        )
        outputs = self._process_samples(seqs, [[t] for t in sampled.token_ids], sampled.logprobs, time.monotonic())
        if self.spec is not None:
            self.spec.record_step(out.scheduled, time.perf_counter() - started)
        return outputs

    def _process_samples(self, seqs: list[Sequence], token_ids: list[list[int]], logprobs: list,
                         now: float) -> list[RequestOutput]:
        """Append each sequence's new tokens (one, or several after a speculative step) in order,
        checking the stop conditions after each: a sequence that stops drops the rest."""
        changed: dict[str, _RequestState] = {}
        for i, seq in enumerate(seqs):
            state = self._requests[seq.request_id]
            if seq.first_token_time is None:
                seq.first_token_time = now
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                    state.metrics.first_scheduled_time = seq.first_scheduled_time
                    state.metrics.num_cached_tokens = seq.num_cached_tokens
            for token_id in token_ids[i]:
                if seq.sampling_params.logprobs is not None:
                    seq.output_logprobs.append(decode_logprobs(logprobs[i], self.tokenizer))
                status = state.texts[seq.index].append_token(token_id, self.eos_token_ids, self.max_model_len)
                self._generation_tokens_total += 1
                if status is None and self.structured.is_constrained(seq.seq_id) and not self.structured.accept(
                        seq.seq_id, token_id):
                    status = SequenceStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
                if status is None and state.handoff:
                    self._export_handoff(state, seq)  # before finish() frees its blocks
                    status = SequenceStatus.FINISHED_ABORTED  # here; it lives on in the next engine
                if status is not None:
                    self.scheduler.finish(seq, status)
                    self._generators.pop(seq.seq_id, None)
                    self.structured.forget(seq.seq_id)
                    if self.spec is not None:
                        self.spec.forget(seq.seq_id)
                    break
            changed[seq.request_id] = state
        return self._request_outputs(changed, now)

    def _request_outputs(self, changed: dict[str, _RequestState], now: float) -> list[RequestOutput]:
        """One output per request that changed this step; finished requests are dropped."""
        outputs = []
        for rid, state in changed.items():
            finished = state.finished
            if not finished and state.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            if finished:
                state.metrics.finished_time = now
                del self._requests[rid]
            with_lp = state.params.logprobs is not None
            handed_off = rid in self._handoffs
            outputs.append(RequestOutput(
                request_id=rid,
                prompt=state.prompt,
                prompt_token_ids=state.prompt_ids,
                outputs=[t.make_output(None if handed_off else t.seq.status.finish_reason, with_lp)
                         for t in state.texts],
                finished=finished,
                metrics=state.metrics,
            ))
            if handed_off:  # what make_output released is what the client will have seen
                self._handoffs[rid][0].emitted_text_len = state.texts[0].emitted
        return outputs

    def set_speculation(self, method: str | None, num_speculative_tokens: int | None = None) -> None:
        """Switch speculative decoding between steps (the autopilot's knob): None turns it off,
        "ngram" on or sets its k. An n-gram decoder turned off is kept, so turning it on again
        resumes its measured costs; the spec_* counters carry over any switch (they stay
        monotonic). A draft-model decoder can be switched off, not back on."""
        if method is None:
            if self.spec is not None:
                # No lookahead slot is held between steps; what the decoder kept per sequence goes.
                for seq in (*self.scheduler.running, *self.scheduler.waiting):
                    self.spec.forget(seq.seq_id)
                self._spec_parked, self.spec = self.spec, None
            return
        if method != "ngram":
            raise ValueError(f"set_speculation: only 'ngram' can be switched on while serving, not {method!r}")
        decoder = self.spec or self._spec_parked
        k = num_speculative_tokens or (decoder.max_k if decoder is not None else self.config.num_speculative_tokens)
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if decoder is None or decoder.method != method:
            decoder = SpeculativeDecoder("ngram", k, self.config.speculative_adaptive, self.kv, self.max_model_len)
            if self._spec_parked is not None:
                decoder.stats = self._spec_parked.stats
        decoder.set_max_k(k)
        self.spec, self._spec_parked = decoder, None

    # ---- disaggregation: handing sequences over between engines (tessera.engine.handoff) -----

    def _export_handoff(self, state: _RequestState, seq: Sequence) -> None:
        n = seq.num_computed_tokens  # the prompt; the first token's K/V are computed by the next engine
        caches = self.runner.kv_caches
        kv = read_kv(caches, seq.block_table, self.kv.block_size, n,
                     out=self.kv_export_alloc((kv_nbytes(caches, n),), torch.uint8))
        gen = self._generators.get(seq.seq_id)
        handoff = SequenceHandoff(
            request_id=seq.request_id, prompt_token_ids=list(seq.prompt_token_ids),
            output_token_ids=list(seq.output_token_ids), params=state.params, num_kv_tokens=n,
            output_logprobs=list(seq.output_logprobs), generator_state=gen.get_state() if gen is not None else None,
            kv_nbytes=kv.numel(),
        )
        self._handoffs[seq.request_id] = (handoff, kv)

    def take_handoff(self, request_id: str) -> tuple[SequenceHandoff, torch.Tensor] | None:
        """The handoff and K/V of a request added with handoff=True whose output came back
        finished with finish_reason None; None if it finished here (or is not done)."""
        return self._handoffs.pop(request_id, None)

    def import_handoff(self, handoff: SequenceHandoff, kv: torch.Tensor | None = None,
                       arrival_time: float | None = None) -> None:
        """Take over a sequence from another engine. With `kv` (the read_kv buffer of its first
        handoff.num_kv_tokens tokens) it decodes on at once, copying only the rows the prefix
        cache lacks, and waits in a queue while the batch or the pool is full; without, it is
        queued to recompute prompt and outputs. Raises ValueError if it can never fit."""
        rid = handoff.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        self._validate_prompt(handoff.prompt_token_ids, handoff.params)
        if kv is not None:
            if handoff.num_kv_tokens != len(handoff.prompt_token_ids) + len(handoff.output_token_ids) - 1:
                raise ValueError(f"request {rid}: K/V for {handoff.num_kv_tokens} tokens, but it has "
                                 f"{len(handoff.prompt_token_ids) + len(handoff.output_token_ids)}: all but the "
                                 f"last needed")
            if kv.numel() != kv_nbytes(self.runner.kv_caches, handoff.num_kv_tokens):
                raise ValueError(f"request {rid}: {kv.numel()} bytes of K/V for {handoff.num_kv_tokens} tokens, but "
                                 f"this engine's cache takes {kv_nbytes(self.runner.kv_caches, handoff.num_kv_tokens)}: "
                                 f"the engines differ in model or --kv-cache-dtype")
        now = time.monotonic()
        state = _RequestState(rid, None, list(handoff.prompt_token_ids), handoff.params,
                              arrival_time if arrival_time is not None else now)
        seq = Sequence(rid, state.prompt_ids, handoff.params, arrival_time=state.metrics.arrival_time)
        seq.output_token_ids = list(handoff.output_token_ids)
        seq.output_logprobs = list(handoff.output_logprobs)
        seq.first_scheduled_time = seq.first_token_time = now  # its first token came from elsewhere
        state.metrics.first_scheduled_time = state.metrics.first_token_time = now
        self.scheduler._check_fits(seq)
        text = SequenceTextState(seq, self.tokenizer)
        text.resume(handoff.emitted_text_len)
        state.texts.append(text)
        if handoff.params.structured_outputs is not None:  # replay its output through a fresh matcher
            self.structured.add_sequence(seq.seq_id, self.structured.compile(handoff.params.structured_outputs).result(),
                                         seq.output_token_ids)
        if handoff.generator_state is not None:
            gen = torch.Generator()
            gen.set_state(handoff.generator_state)
            self._generators[seq.seq_id] = gen
        self._requests[rid] = state
        if kv is None:
            self.scheduler.add(seq)
        else:
            self._pending_imports.append((seq, kv))
            self._admit_imports()

    def _admit_imports(self) -> None:
        """Move imported sequences with K/V into the running batch, oldest first, while the
        batch and the pool have room (all-or-nothing per sequence, like an admission)."""
        sched = self.scheduler
        while self._pending_imports and sched.num_running < sched.max_num_seqs:
            seq, kv = self._pending_imports[0]
            if seq.is_finished:  # aborted while it waited
                self._pending_imports.pop(0)
                continue
            n = seq.num_tokens - 1  # all but the last token have K/V
            if not self.kv.allocate_for_admission(seq, 1, num_restored_tokens=n):
                break
            self._pending_imports.pop(0)
            if getattr(self.kv, "host", None) is not None:  # demotions of evicted blocks must leave before we overwrite
                demote, promote = self.kv.take_block_copies()
                self.runner.swap_blocks(demote, promote)
            write_kv(self.runner.kv_caches, seq.block_table, self.kv.block_size, kv, n, seq.num_cached_tokens)
            self.kv.commit_computed(seq)
            sched.add_running(seq)

    # ---- introspection --------------------------------------------------------------------

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_usable_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            last_step_num_seqs=self._last_step[0],
            last_step_num_tokens=self._last_step[1],
            last_step_time_s=self._last_step_time,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            prefix_cache_hit_rate=kv.prefix_hit_rate,
            num_evicted_blocks=kv.num_evictions,
            **self._host_stats(),
            **((self.spec or self._spec_parked).engine_stats() if (self.spec or self._spec_parked) else {}),
        )

    def _host_stats(self) -> dict:
        host = self.host_pool
        if host is None:
            return {}
        return dict(num_swapped_out_blocks=host.num_swapped_out_blocks, num_swapped_in_blocks=host.num_swapped_in_blocks,
                    num_swapped_seqs=host.num_swapped_seqs, num_host_free_blocks=host.num_free_blocks,
                    num_host_total_blocks=host.num_blocks, num_demoted_blocks=host.num_demoted_blocks,
                    num_promoted_blocks=host.num_promoted_blocks, num_host_cached_blocks=host.num_cached_blocks)

    def check_invariants(self) -> None:
        """The KV invariant over every live sequence; tests call it after every step."""
        live = [t.seq for state in self._requests.values() for t in state.texts if not t.seq.is_finished]
        self.kv.check_invariants(live)
        if self.host_pool is not None:
            self.host_pool.check_invariants(live)
        if self.spec is not None:
            self.spec.check_invariants()
