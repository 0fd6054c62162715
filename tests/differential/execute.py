"""Running one case: the engines its features ask for, the workload step by step, the checks.

Every request's outputs are compared with the same request run alone on the plain engine (no
prefix caching, one prefill chunk, an ample pool, no speculation or handoff; the same dtype,
weight quantization and KV cache dtype). float32 engines run with `deterministic` (the fixed-order
fp32 linears): that is where Tessera guarantees float32 invariance; MKL's default linears differ
in the last bit between row counts, which flips a near tie now and then (an int8-KV case with a
4.8e-6 logprob gap did). Checked as well: the KV invariant after every step,
streamed deltas adding up to the final output, an aborted request's tokens being a prefix of
its reference, and every engine's pools empty at the end.

What is not compared, and why: sampled requests under draft-model speculation (rejection
sampling with a draft's distribution preserves the output distribution, not the tokens).
"""

from __future__ import annotations

import json
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.model.weights import load_model_files
from tessera.outputs import CompletionOutput
from tessera.quant.kv import kv_bytes_per_token
from tessera.sampling import SamplingParams
from tests.differential.case import MAX_OUTPUT, Case, Features, Request

MAX_STEPS = 5_000
AMPLE_TOKENS = 8192
HOST_BLOCKS = 48  # the host tier when swap_space is on: enough for some victims, not all


@dataclass
class Failure:
    kind: str  # mismatch | stream | abort | invariant | leak | crash
    rid: str
    message: str
    case: Case | None = None
    features: list[str] = field(default_factory=list)  # the minimal case's active features, once shrunk


@dataclass
class Outcome:
    failures: list[Failure]
    events: Counter  # what the case exercised (preemptions, swaps, hits, accepted proposals, ...)


@dataclass
class Reference:
    token_ids: list[int]
    text: str
    finish_reason: str | None


class Context:
    """The model under test and the cache of reference outputs (one plain engine per kv/quant)."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        files = load_model_files(self.model_dir)
        self.model_config = files.config
        self.vocab = files.config.vocab_size
        self._plain: dict[tuple[str, str], LLMEngine] = {}
        self._refs: dict[tuple, list[Reference]] = {}

    def engine_config(self, f: Features, **overrides) -> EngineConfig:
        bpt = kv_bytes_per_token(self.model_config, _torch_dtype(self.dtype), f.kv_cache_dtype)
        kw: dict = dict(
            model=str(self.model_dir), dtype=self.dtype, deterministic=self.dtype == "float32",
            enable_prefix_caching=f.prefix_caching,
            max_num_batched_tokens=f.budget, max_num_seqs=f.max_num_seqs, block_size=f.block_size,
            kv_cache_memory=AMPLE_TOKENS * bpt, kv_cache_dtype=f.kv_cache_dtype, quantization=f.quantization,
            preemption_mode=f.preemption if f.swap_space else "recompute",
            swap_space=HOST_BLOCKS * f.block_size * bpt / (1 << 30) if f.swap_space else 0.0,
        )
        if f.spec != "off":
            kw.update(speculative_method="ngram" if f.spec == "ngram" else "draft",
                      num_speculative_tokens=f.num_spec_tokens, speculative_adaptive=f.spec_adaptive)
            if f.spec.startswith("draft"):
                kw.update(draft_model="self", draft_quantization="int8" if f.spec == "draft-int8" else "none")
        kw.update(overrides)
        return EngineConfig(**kw)

    def pool_bytes(self, case: Case) -> int:
        """A tiny pool: room for the largest sequence plus two blocks, so several running at
        once must preempt one another."""
        f = case.features
        need = max(-(-(len(r.prompt) + r.params.get("max_tokens", 16)) // f.block_size) for r in case.requests)
        bpt = kv_bytes_per_token(self.model_config, _torch_dtype(self.dtype), f.kv_cache_dtype)
        return (need + 2) * f.block_size * bpt

    def reference(self, f: Features, prompt: list[int], params: dict) -> list[Reference]:
        """The request alone on the plain engine: one Reference per sample (n)."""
        key = (f.reference_key(), tuple(prompt), json.dumps(params, sort_keys=True))
        if key not in self._refs:
            engine = self._plain_engine(f)
            engine.add_request("ref", prompt, SamplingParams(**params))
            final = None
            for _ in range(MAX_STEPS):
                if not engine.has_unfinished_requests():
                    break
                for out in engine.step():
                    if out.finished:
                        final = out
            assert final is not None, "the reference did not finish"
            self._refs[key] = [Reference(c.token_ids, c.text, c.finish_reason) for c in final.outputs]
        return self._refs[key]

    def _plain_engine(self, f: Features) -> LLMEngine:
        key = f.reference_key()
        if key not in self._plain:
            plain = Features(kv_cache_dtype=f.kv_cache_dtype, quantization=f.quantization)
            self._plain[key] = LLMEngine(self.engine_config(plain))
        return self._plain[key]


def _torch_dtype(dtype: str) -> torch.dtype:
    from tessera.config import resolve_dtype

    return resolve_dtype(dtype)


class _Run:
    """The state of one case while it runs: engines, per-request streams and finals."""

    def __init__(self, ctx: Context, case: Case) -> None:
        self.ctx, self.case = ctx, case
        f = case.features
        overrides = {"kv_cache_memory": ctx.pool_bytes(case)} if f.pool == "tiny" else {}
        self.engines = [LLMEngine(ctx.engine_config(f, **overrides))]
        if f.handoff:
            self.engines.append(LLMEngine(ctx.engine_config(f, **overrides)))  # [prefill, decode]
        self.streamed: dict[str, dict[int, list[int]]] = {r.rid: {} for r in case.requests}
        self.streamed_text: dict[str, dict[int, str]] = {r.rid: {} for r in case.requests}
        self.final: dict[str, list[CompletionOutput]] = {}
        self.aborted: set[str] = set()
        self.events: Counter = Counter()

    def add(self, r: Request) -> None:
        params = SamplingParams(**r.params)
        if self.case.features.handoff and params.n == 1:
            self.engines[0].add_request(r.rid, r.prompt, params, handoff=True)
        else:
            self.engines[-1].add_request(r.rid, r.prompt, params)

    def step_all(self) -> None:
        for engine in self.engines:
            if not engine.has_unfinished_requests():
                continue
            for out in engine.step():
                for c in out.outputs:
                    self.streamed[out.request_id].setdefault(c.index, []).extend(c.delta_token_ids)
                    texts = self.streamed_text[out.request_id]
                    texts[c.index] = texts.get(c.index, "") + c.delta_text
                handoff = engine.take_handoff(out.request_id) if len(self.engines) > 1 and engine is self.engines[0] \
                    else None
                if handoff is not None:
                    self.events["handoffs"] += 1
                    self.engines[1].import_handoff(*handoff)
                elif out.finished:
                    self.final[out.request_id] = out.outputs
            engine.check_invariants()

    def abort(self, rid: str) -> None:
        if rid in self.final:
            return
        for engine in self.engines:
            engine.abort_request(rid)
        self.aborted.add(rid)
        self.events["aborts"] += 1
        for engine in self.engines:
            engine.check_invariants()

    @property
    def busy(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)


def run_case(ctx: Context, case: Case) -> Outcome:
    """Run the case and check it; every exception becomes a failure (kind crash or invariant)."""
    try:
        return _run_case(ctx, case)
    except AssertionError as exc:  # kv/host check_invariants raise AssertionError
        return Outcome([Failure("invariant", "-", f"{exc!r}\n{traceback.format_exc(limit=6)}", case)], Counter())
    except Exception as exc:
        return Outcome([Failure("crash", "-", f"{exc!r}\n{traceback.format_exc(limit=8)}", case)], Counter())


def _run_case(ctx: Context, case: Case) -> Outcome:
    run = _Run(ctx, case)
    pending = sorted(case.requests, key=lambda r: r.arrival_step)
    abort_at = {r.rid: r.arrival_step + r.abort_after for r in case.requests if r.abort_after is not None}
    step = 0
    while pending or run.busy:
        while pending and pending[0].arrival_step <= step:
            run.add(pending.pop(0))
        for rid, at in abort_at.items():
            if at == step:
                run.abort(rid)
        run.step_all()
        step += 1
        if step > MAX_STEPS:
            raise RuntimeError(f"the case did not finish in {MAX_STEPS} steps")
    failures = _check_outputs(ctx, case, run)
    failures += _check_drained(run, case)
    return Outcome(failures, _events(run, case))


def _check_outputs(ctx: Context, case: Case, run: _Run) -> list[Failure]:
    failures = []
    f = case.features
    for r in case.requests:
        refs = ctx.reference(f, r.prompt, r.params)
        sampled = r.params.get("temperature", 1.0) > 0
        compare = not (sampled and f.spec.startswith("draft"))
        if r.rid in run.aborted:
            for i, got in run.streamed[r.rid].items():
                if compare and got != refs[i].token_ids[: len(got)]:
                    failures.append(Failure("abort", r.rid, f"sample {i}: the aborted request streamed {got}, "
                                            f"not a prefix of its reference {refs[i].token_ids}", case))
            continue
        outs = run.final.get(r.rid)
        if outs is None:
            failures.append(Failure("crash", r.rid, "the request never finished", case))
            continue
        for c in outs:
            streamed = run.streamed[r.rid].get(c.index, [])
            if streamed != c.token_ids or run.streamed_text[r.rid].get(c.index, "") != c.text:
                failures.append(Failure("stream", r.rid, f"sample {c.index}: streamed {streamed} "
                                        f"{run.streamed_text[r.rid].get(c.index, '')!r} but the final output is "
                                        f"{c.token_ids} {c.text!r}", case))
            ref = refs[c.index]
            if compare and (c.token_ids != ref.token_ids or c.text != ref.text or c.finish_reason != ref.finish_reason):
                failures.append(Failure("mismatch", r.rid, _describe_mismatch(ctx, f, r, c, ref), case))
    return failures


def _describe_mismatch(ctx: Context, f: Features, r: Request, got: CompletionOutput, ref: Reference) -> str:
    """Where the tokens part, and how close the reference's logprobs of the two tokens were
    there: a near tie points at numerics, a wide gap at a bug."""
    a, b = got.token_ids, ref.token_ids
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    msg = (f"sample {got.index}: first difference at output token {at}: got {a[at:at + 4]} "
           f"(finish {got.finish_reason}), alone {b[at:at + 4]} (finish {ref.finish_reason}); "
           f"prompt {len(r.prompt)} tokens, params {r.params}")
    if at < min(len(a), len(b)) and r.params.get("temperature", 1.0) == 0:
        gap = logprob_gap(ctx, f, r.prompt + b[:at], b[at], a[at])
        msg += f"; reference logprob gap between them: {gap}"
    return msg


def logprob_gap(ctx: Context, f: Features, context: list[int], ref_token: int, got_token: int) -> str:
    """logprob(ref_token) - logprob(got_token) after `context` on the plain engine."""
    params = dict(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20)
    engine = ctx._plain_engine(f)
    engine.add_request("gap", context, SamplingParams(**params))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    lp = final.outputs[0].logprobs[0]
    if got_token not in lp:
        return f">{lp[ref_token].logprob - min(v.logprob for v in lp.values()):.4g} (not in the top 20)"
    return f"{lp[ref_token].logprob - lp[got_token].logprob:.4g}"


def _check_drained(run: _Run, case: Case) -> list[Failure]:
    failures = []
    for i, engine in enumerate(run.engines):
        s = engine.stats()
        if s.kv_cache_usage != 0 or s.num_free_blocks != s.num_total_blocks:
            failures.append(Failure("leak", "-", f"engine {i}: {s.num_total_blocks - s.num_free_blocks} KV blocks "
                                    f"still held after every request ended", case))
        if s.num_host_total_blocks and (s.num_host_free_blocks != s.num_host_total_blocks or s.num_swapped_seqs):
            failures.append(Failure("leak", "-", f"engine {i}: host pool holds {s.num_swapped_seqs} sequences, "
                                    f"{s.num_host_free_blocks} of {s.num_host_total_blocks} blocks free", case))
    return failures


def _events(run: _Run, case: Case) -> Counter:
    ev = run.events
    for engine in run.engines:
        s = engine.stats()
        ev["preemptions"] += s.num_preemptions
        ev["swapped_out_blocks"] += s.num_swapped_out_blocks
        ev["demoted_blocks"] += s.num_demoted_blocks
        ev["promoted_blocks"] += s.num_promoted_blocks
        ev["prefix_hit_tokens"] += s.prefix_cache_hits
        ev["spec_accepted_tokens"] += s.spec_num_accepted_tokens
    for r in case.requests:
        p = r.params
        ev["requests"] += 1
        ev["seeded_sampling" if p.get("temperature", 1.0) > 0 else "greedy"] += 1
        ev["n>1"] += p.get("n", 1) > 1
        ev["stop_strings"] += bool(p.get("stop"))
        ev["stopped_by_string"] += any(c.finish_reason == "stop" and isinstance(c.stop_reason, str)
                                       for c in run.final.get(r.rid, []))
    ev["prefill_chunks_split"] += any(len(r.prompt) > case.features.budget for r in case.requests)
    return ev


__all__ = ["MAX_OUTPUT", "Context", "Failure", "Outcome", "logprob_gap", "run_case"]
