"""`tessera serve --autopilot`: switch optimizations while serving, from live metrics.

The Autopilot is a StepObserver: the engine thread calls `on_step` after every step (the engine
is single-threaded, so changing it there is safe), and it changes three knobs:

- prefix caching: off when the hit rate (by prompt tokens) stays under `hit_rate_off` over a
  window of `prefix_window_tokens` looked-up tokens, back on when a shadow index (the same
  chained block hashes, cheap ones, in an LRU as large as the KV pool) would have hit at least
  `hit_rate_on` over a window while it was off;
- the chunked-prefill token budget: cut while more than a tenth of the window's requests had
  the p99 of their inter-token gaps clearly over the ITL objective (the way goodput counts a
  request; "clearly": over (1 + `itl_margin`) x the objective), in proportion, to the power of
  two under budget x objective / measured; doubled while the p90 TTFT exceeds its objective and
  ITL has room, never straight back to a budget that broke the ITL objective a short while ago.
  Steps that held decoding requests past the ITL objective while they ran a prefill chunk cut
  the budget without waiting for a window (such a step already spoiled every request it
  delayed, and a burst is over before a window of finished requests fills): at once when one
  step is clearly over, or when `step_reaction_repeats` of the last `step_reaction_steps` such
  steps were over at all. Before that can happen, the step times themselves cap the budget:
  from decode-only steps and steps with a prefill chunk (`cost_min_samples` of each at least)
  the autopilot estimates what a prompt token adds to a step, and keeps the budget at the chunk
  that still fits `step_fill` of the ITL objective next to the decodes, as Sarathi-Serve sizes
  its chunks from the TBT objective; it halves the budget at most per cut and waits for fresh
  samples before the next. Given step costs measured before serving (`step_costs`: the
  advisor's, or `tessera serve`'s cached probe), the modelled cap is in place before the first
  step, so the first chunk next to a decode already fits. Every cut bounds only steps that hold
  a decode: a step in which nothing decodes keeps the configured budget
  (`Scheduler.prefill_only_budget`), so a burst into an idle engine is prefilled in as few steps
  as with the defaults (session 15: the cut 512 -> 256 alone cost bursty 2-5% of goodput and
  raised its ITL p90 from 17 to 54 ms, each burst's second half of prefill holding the first
  half's decodes). All of this needs more than one step of evidence because the
  machine is noisy: on a shared VM one step can be 1.5-2x slow for reasons the budget has
  nothing to do with (session 7, docs/advisor.md: one first estimate cut bursty 512 -> 128,
  one step 0.7% over the objective cut summarization 256 -> 224 -> 112);
- n-gram speculation and its k (tessera/advisor/spec_pilot.py): a shadow replay of the engine's
  proposer on the tokens requests really produce measures acceptance, on or off; every
  `spec_window_tokens` output tokens the modelled speedup of the best k (from that acceptance,
  the batch and the step costs: measured decode steps and what a prompt token adds to a step,
  or `step_costs` when given, e.g. the advisor's) turns speculation on at >= `spec_on_speedup`,
  off under `spec_off_speedup`, or moves k while on.

The decision half (`record_*` then `decide`) touches no engine, so tests feed it metric
sequences; `apply` is the only code that changes an engine (through its public knobs). Every
change is a `Decision` record (time, knob, old, new, reason, figures), logged, kept in
`changes` (`decisions()` hands out a copy, for the dashboard), and counted in the Prometheus
counter `tessera:autopilot_decisions_total{knob=...}`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from tessera.advisor.sim import StepCosts, percentile
from tessera.advisor.spec_pilot import ShadowNgram, best_k, speedup

logger = logging.getLogger("tessera.autopilot")


@dataclass(frozen=True)
class AutopilotConfig:
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    hit_rate_off: float = 0.02  # prefix caching off below this windowed hit rate ...
    hit_rate_on: float = 0.10  # ... and back on above this shadow hit rate (hysteresis between)
    prefix_window_tokens: int = 8192  # prompt tokens looked up per prefix decision
    itl_window: int = 16  # request ITL figures (each request's p99 gap) per latency decision
    ttft_window: int = 16  # first tokens per latency decision
    itl_slack: float = 0.6  # the budget grows for TTFT only while the ITL figure < this x the ITL objective
    # A request's ITL figure: this percentile of its inter-token gaps (99, as the advisor's goodput
    # counts a request), taken when it finishes or every itl_chunk gaps of a long stream.
    itl_percentile: float = 99.0
    itl_chunk: int = 32
    min_budget: int = 64
    max_budget: int = 8192
    # A budget that broke the ITL objective is not tried again for TTFT for this many latency
    # windows (no flapping between two budgets; load changes, so it is retried eventually).
    itl_memory_windows: int = 20
    # The step reaction watches steps with a prefill chunk of at least this many tokens that made
    # a decoding request wait (0 = only the windowed rule).
    step_reaction_min_prefill: int = 16
    # One step is weak evidence on a shared machine (one step 1.5-2x slow happens for reasons the
    # budget has nothing to do with: in session 7 a single 274.5 ms step against a 272.6 ms
    # objective cut summarization 256 -> 224 -> 112, and the autopilot scored 80% of the best).
    # So one step, or a window of requests (they mostly share the same slow steps), cuts at once
    # only when its ITL is over (1 + itl_margin) x the objective; a smaller overshoot cuts when it
    # repeats: in step_reaction_repeats of the last step_reaction_steps prefill steps that held a
    # decoding request. itl_margin=0 with step_reaction_repeats=1 is the rule before session 8.
    itl_margin: float = 0.10
    step_reaction_repeats: int = 2
    step_reaction_steps: int = 4
    # The measured-cost cap: a full chunk plus the decodes should take at most this share of the
    # ITL objective; estimates are the minimum (per prompt token) and median (decode-only steps)
    # over the last `cost_samples` steps, so one step slowed by the machine does not move them.
    step_fill: float = 0.7
    cost_samples: int = 8
    # ... and it acts only with cost_min_samples of each kind (prefill-chunk steps and decode-only
    # steps; fresh prefill ones since its last cut), halving the budget at most per cut: in
    # session 7 a first estimate of 0.89 ms a prompt token (0.49 in the fit) cut bursty 512 -> 128
    # at once, and the autopilot scored 86% of the best against 100% for the defaults.
    cost_min_samples: int = 3
    # Speculation: steered at all; the largest k; output tokens replayed per decision; the
    # modelled speedup that turns it on, and the one under which it goes off (hysteresis).
    steer_speculation: bool = True
    spec_max_k: int = 8
    spec_window_tokens: int = 512
    spec_on_speedup: float = 1.15
    spec_off_speedup: float = 1.0
    # Step costs measured before serving (e.g. the advisor's): the first budget cap, before any
    # step, and the speculation model's costs; None: the cap waits for measured steps, and
    # speculation uses the live median decode-only step and smallest per-prompt-token estimate.
    step_costs: StepCosts | None = None


KNOBS = ("enable_prefix_caching", "max_num_batched_tokens", "speculative_method", "num_speculative_tokens")


@dataclass(frozen=True)
class Decision:
    """One change the autopilot made: a plain record the log, metrics and dashboard read."""

    time: float  # the engine clock (time.monotonic) when it was decided
    knob: str  # one of KNOBS
    old: object
    new: object
    reason: str
    figures: dict = field(default_factory=dict)  # the measured figures and thresholds behind it


Change = Decision  # the earlier name


class _ShadowPrefixIndex:
    """Which chained block prefixes a prefix cache of `capacity` blocks would hold, by Python
    hashes (collisions only blur an estimate here, never an output)."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = max(1, capacity)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def _hashes(self, token_ids: list[int], num_blocks: int) -> list[int]:
        out, parent, bs = [], 0, self.block_size
        for i in range(num_blocks):
            parent = hash((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            out.append(parent)
        return out

    def lookup(self, token_ids: list[int]) -> int:
        """Tokens of the longest cached prefix (leaving one token to compute, as the engine does)."""
        hit = 0
        for h in self._hashes(token_ids, (len(token_ids) - 1) // self.block_size):
            if h not in self._lru:
                break
            self._lru.move_to_end(h)
            hit += self.block_size
        return hit

    def insert(self, token_ids: list[int]) -> None:
        for h in self._hashes(token_ids, len(token_ids) // self.block_size):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


class Autopilot:
    def __init__(self, config: AutopilotConfig, *, enable_prefix_caching: bool, max_num_batched_tokens: int,
                 max_num_seqs: int = 64, block_size: int = 16, kv_capacity_blocks: int = 1 << 16,
                 speculative_method: str | None = None, num_speculative_tokens: int = 4) -> None:
        self.config = config
        self.prefix_caching = enable_prefix_caching
        self.budget = max_num_batched_tokens
        self.configured_budget = max_num_batched_tokens  # kept for steps with no decode (see apply)
        self.max_num_seqs = max_num_seqs
        self.spec_method = speculative_method
        self.spec_k = num_speculative_tokens
        self._spec_shadow = ShadowNgram(config.spec_max_k)
        self._spec_batch: list[int] = []  # sequences per step over the speculation window
        self._spec_measured = (0, 0)  # (proposed, accepted) by the engine over the window, while on
        self.last_spec: dict | None = None  # the figures of the last speculation window
        self.changes: list[Decision] = []
        self._shadow = _ShadowPrefixIndex(block_size, kv_capacity_blocks)
        self._prefix_q = self._prefix_h = 0  # the current window, tokens
        self._itl: list[float] = []
        self._ttft: list[float] = []
        self.last_hit_rate: float | None = None
        self.last_itl: float | None = None  # p90 over the window's requests of their ITL figure, seconds
        self.last_p90_ttft: float | None = None
        self._itl_ceiling: int | None = None  # the smallest budget seen breaking the ITL objective
        self._slow_step: tuple[float, int] | None = None  # (longest gap, prefill tokens) of the step to act on
        self._held_steps: list[tuple[float, int]] = []  # the same of recent prefill steps that held a decode
        self._decode_step_s: list[float] = []  # recent decode-only step times
        self._prefill_steps: list[tuple[float, int]] = []  # recent (time, prompt tokens) of prefill-chunk steps
        self._fresh_prefill = 0  # prefill-chunk steps measured since the last cut by the cap
        self.budget_cap: int | None = None  # the largest chunk the measured costs fit under the ITL objective
        self._ceiling_age = 0
        # Engine glue state (on_step).
        self._engine = None
        self._last_prefix = (0, 0)
        self._last_spec = (0, 0)
        self._last_token_time: dict[str, float] = {}
        self._gaps: dict[str, list[float]] = {}
        if config.step_costs is not None and config.slo_itl_ms is not None:
            self._cut_to_modelled_cap(config.step_costs)

    @classmethod
    def for_engine(cls, engine, config: AutopilotConfig) -> Autopilot:
        """An autopilot that starts from `engine`'s current settings and changes that engine."""
        ap = cls(config, enable_prefix_caching=engine.kv.enable_prefix_caching,
                 max_num_batched_tokens=engine.scheduler.max_num_batched_tokens,
                 max_num_seqs=engine.config.max_num_seqs, block_size=engine.kv.block_size,
                 kv_capacity_blocks=engine.kv.num_usable_blocks,
                 speculative_method=engine.spec.method if engine.spec is not None else None,
                 num_speculative_tokens=(engine.spec.max_k if engine.spec is not None
                                         else min(engine.config.num_speculative_tokens, config.spec_max_k)))
        ap._engine = engine
        ap.apply(engine, ap.changes)  # the cut the step costs given in config call for, before any step
        stats = engine.stats()
        ap._last_prefix = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        ap._last_spec = (stats.spec_num_proposed_tokens, stats.spec_num_accepted_tokens)
        return ap

    def decisions(self) -> list[Decision]:
        """Every change made so far, oldest first (a copy: the engine thread appends to the original)."""
        return list(self.changes)

    # ---- metrics in ----------------------------------------------------------------------------

    def record_prefix(self, queries: int, hits: int) -> None:
        """Prompt tokens looked up in the real prefix cache, and hits, since the last call (while on)."""
        if self.prefix_caching:
            self._prefix_q += queries
            self._prefix_h += hits

    def record_prompt(self, token_ids: list[int]) -> None:
        """A newly admitted prompt: while caching is off, the shadow index measures what it would hit."""
        if not self.prefix_caching:
            self._prefix_q += len(token_ids)
            self._prefix_h += self._shadow.lookup(token_ids)
        self._shadow.insert(token_ids)

    def record_finished(self, token_ids: list[int]) -> None:
        """A finished sequence (prompt + output): its blocks stay cached, as in the engine."""
        self._shadow.insert(token_ids)

    def record_itl(self, seconds: float) -> None:
        """One request's ITL figure: the itl_percentile of its inter-token gaps."""
        self._itl.append(seconds)

    def record_ttft(self, seconds: float) -> None:
        self._ttft.append(seconds)

    def record_output(self, request_id: str, prompt: list[int] | None, new_tokens: list[int],
                      finished: bool = False) -> None:
        """A request's new output tokens (give its prompt with the first ones): the speculation shadow replays them."""
        if prompt is not None:
            self._spec_shadow.start(request_id, prompt)
        self._spec_shadow.extend(request_id, new_tokens)
        if finished:
            self._spec_shadow.finish(request_id)

    def record_spec_measured(self, proposed: int, accepted: int, batch: int) -> None:
        """A step's draft tokens the engine verified and accepted, and the sequences it ran."""
        p, a = self._spec_measured
        self._spec_measured = (p + proposed, a + accepted)
        if batch:
            self._spec_batch.append(batch)

    def record_step(self, max_gap_s: float, prefill_tokens: int, step_time_s: float | None = None) -> None:
        """One engine step: the longest inter-token gap it gave a decoding request, the prompt
        tokens it computed and its wall time. A step past the ITL objective only counts when a
        prefill chunk ran in it: without one, a smaller budget would not have made it shorter."""
        cfg = self.config
        if step_time_s is not None:
            self._record_cost(step_time_s, prefill_tokens)
        if (cfg.slo_itl_ms is None or not cfg.step_reaction_min_prefill
                or prefill_tokens < cfg.step_reaction_min_prefill or max_gap_s <= 0):
            return
        self._held_steps = (self._held_steps + [(max_gap_s, prefill_tokens)])[-cfg.step_reaction_steps :]
        over = [s for s in self._held_steps if s[0] * 1e3 > cfg.slo_itl_ms]
        if not over:
            return
        # One clear overshoot, or a repeated one (module docstring); then the worst such step.
        if max_gap_s * 1e3 > cfg.slo_itl_ms * (1 + cfg.itl_margin) or len(over) >= cfg.step_reaction_repeats:
            worst = max(over)
            if self._slow_step is None or worst[0] > self._slow_step[0]:
                self._slow_step = worst

    # ---- decisions -------------------------------------------------------------------------------

    def decide(self, now: float) -> list[Decision]:
        changes = self._decide_prefix(now) + self._decide_budget(now) + self._decide_speculation(now)
        for c in changes:
            logger.info("autopilot: %s %s -> %s (%s) %s", c.knob, c.old, c.new, c.reason, c.figures)
        self.changes += changes
        return changes

    def _decide_prefix(self, now: float) -> list[Decision]:
        cfg = self.config
        if self._prefix_q < cfg.prefix_window_tokens:
            return []
        rate = self._prefix_h / self._prefix_q
        self.last_hit_rate = rate
        queried = self._prefix_q
        self._prefix_q = self._prefix_h = 0
        if self.prefix_caching and rate < cfg.hit_rate_off:
            self.prefix_caching = False
            return [Decision(now, "enable_prefix_caching", True, False,
                             f"hit rate {rate:.1%} over {queried} prompt tokens < {cfg.hit_rate_off:.0%}",
                             {"hit_rate": rate, "window_tokens": queried, "hit_rate_off": cfg.hit_rate_off})]
        if not self.prefix_caching and rate >= cfg.hit_rate_on:
            self.prefix_caching = True
            return [Decision(now, "enable_prefix_caching", False, True,
                             f"shadow hit rate {rate:.1%} over {queried} prompt tokens >= {cfg.hit_rate_on:.0%}",
                             {"shadow_hit_rate": rate, "window_tokens": queried, "hit_rate_on": cfg.hit_rate_on})]
        return []

    def _decide_budget(self, now: float) -> list[Decision]:
        changes = self._decide_budget_once(now)
        if changes:
            self._held_steps = []  # steps run at the old budget are no evidence against the new one
        return changes

    def _decide_budget_once(self, now: float) -> list[Decision]:
        cfg = self.config
        if cfg.slo_itl_ms is None and cfg.slo_ttft_ms is None:
            return []
        if self._slow_step is not None:
            return self._cut_for_slow_step(now)
        cut = self._cut_to_cap(now)
        if cut:
            return cut
        if len(self._itl) < cfg.itl_window and len(self._ttft) < cfg.ttft_window:
            return []
        itl = percentile(self._itl, 90) if self._itl else None
        ttft = percentile(self._ttft, 90) if self._ttft else None
        self.last_itl, self.last_p90_ttft = itl, ttft
        self._itl, self._ttft = [], []
        self._ceiling_age += 1
        if self._ceiling_age > cfg.itl_memory_windows:
            self._itl_ceiling = None
        old = self.budget
        new, reason = old, ""
        q = f"p90 over requests of their p{cfg.itl_percentile:g}"
        if cfg.slo_itl_ms is not None and itl is not None and itl * 1e3 > cfg.slo_itl_ms * (1 + cfg.itl_margin):
            # A step's time grows about linearly with its chunk: aim under the objective at once.
            target = old * cfg.slo_itl_ms / (itl * 1e3) * 0.9
            new = max(cfg.min_budget, min(old // 2, 1 << max(0, int(target).bit_length() - 1)))
            reason = f"{q} ITL {itl * 1e3:.1f} ms > objective {cfg.slo_itl_ms:g} ms + {cfg.itl_margin:.0%}"
            self._itl_ceiling, self._ceiling_age = min(old, self._itl_ceiling or old), 0
        elif (cfg.slo_ttft_ms is not None and ttft is not None and ttft * 1e3 > cfg.slo_ttft_ms
              and (cfg.slo_itl_ms is None or itl is None or itl * 1e3 < cfg.itl_slack * cfg.slo_itl_ms)):
            new = min(cfg.max_budget, old * 2, self.budget_cap or cfg.max_budget)
            if self._itl_ceiling is not None and new >= self._itl_ceiling:
                new = old  # that budget broke the ITL objective a short while ago
            reason = f"p90 TTFT {ttft * 1e3:.1f} ms > objective {cfg.slo_ttft_ms:g} ms"
            if itl is not None:
                reason += f", {q} ITL {itl * 1e3:.1f} ms leaves room"
        if new == old:
            return []
        self.budget = new
        return [Decision(now, "max_num_batched_tokens", old, new, reason,
                         {"p90_itl_s": itl, "p90_ttft_s": ttft, "slo_itl_ms": cfg.slo_itl_ms,
                          "slo_ttft_ms": cfg.slo_ttft_ms, "itl_ceiling": self._itl_ceiling})]

    def _record_cost(self, step_time_s: float, prefill_tokens: int) -> None:
        cfg = self.config
        if prefill_tokens == 0:
            self._decode_step_s = (self._decode_step_s + [step_time_s])[-cfg.cost_samples :]
        elif prefill_tokens >= cfg.step_reaction_min_prefill:
            self._prefill_steps = (self._prefill_steps + [(step_time_s, prefill_tokens)])[-cfg.cost_samples :]
            self._fresh_prefill += 1
        else:
            return
        per_token = self._per_token_s()
        if (cfg.slo_itl_ms is None or per_token is None or per_token <= 0
                or min(len(self._decode_step_s), len(self._prefill_steps)) < cfg.cost_min_samples):
            return
        room = cfg.slo_itl_ms / 1e3 * cfg.step_fill - self._step_base_s()
        self.budget_cap = max(cfg.min_budget, int(room / per_token) // 16 * 16)

    def _step_base_s(self) -> float:
        """What a step costs besides its prompt tokens: the median decode-only step (0 before one)."""
        return percentile(self._decode_step_s, 50) if self._decode_step_s else 0.0

    def _per_token_s(self) -> float | None:
        """What a prompt token adds to a step: the smallest of the recent prefill-chunk steps' less
        the base, recomputed with the current base (a step slowed by the machine is never the
        smallest); None before a decode-only and a prefill-chunk step were measured."""
        if not self._decode_step_s or not self._prefill_steps:
            return None
        base = self._step_base_s()
        return min(max(t - base, 0.0) / n for t, n in self._prefill_steps)

    def _cut_to_modelled_cap(self, costs: StepCosts) -> None:
        """Before any step: the largest chunk (in blocks of 16) that the step cost model puts, next
        to one decode and at the costs' own slowdown, within `step_fill` of the ITL objective is
        the first budget cap, and a budget above it (by more than the 10% hysteresis of
        _cut_to_cap) is cut to it at once. Without it the first chunk next to a decode ran at the
        full budget: on the Azure-style trace (session 14) one 509-token chunk held a decode
        224.6 ms against a 158.5 ms objective and spoiled two requests before the reactive cuts.
        The live estimates replace the cap once they have their samples."""
        cfg = self.config
        room = cfg.slo_itl_ms / 1e3 * cfg.step_fill

        def modelled(c: int) -> float:  # a fresh prompt's chunk attends to itself: c (c + 1) / 2 pairs
            return costs.step_time(c, 1, c * (c + 1) / 2) * costs.slowdown

        cap = cfg.min_budget
        while cap + 16 <= cfg.max_budget and modelled(cap + 16) <= room:
            cap += 16
        self.budget_cap = cap
        if self.budget <= cap * 1.1:
            return
        old, self.budget = self.budget, cap
        decision = Decision(time.monotonic(), "max_num_batched_tokens", old, cap,
                            f"step costs {costs.source}: a {cap}-token chunk next to a decode is modelled at "
                            f"{modelled(cap) * 1e3:.1f} ms, {cfg.step_fill:.0%} of the ITL objective {cfg.slo_itl_ms:g} ms",
                            {"modelled_step_s": modelled(cap), "budget_cap": cap, "step_fill": cfg.step_fill,
                             "slo_itl_ms": cfg.slo_itl_ms, "base_s": costs.base_s, "per_decode_s": costs.per_decode_s,
                             "per_prompt_token_s": costs.per_prefill_token_s,
                             "per_attention_s": costs.per_attention_s, "slowdown": costs.slowdown})
        logger.info("autopilot: %s %s -> %s (%s)", decision.knob, old, cap, decision.reason)
        self.changes.append(decision)

    def _cut_to_cap(self, now: float) -> list[Decision]:
        old, cfg = self.budget, self.config
        # 10% of hysteresis: the estimates drift a little with every step; the budget need not.
        # Fresh samples since the last cut: the next halving needs new evidence, not the same.
        if (self.budget_cap is None or old <= self.budget_cap * 1.1
                or self._fresh_prefill < cfg.cost_min_samples):
            return []
        self.budget = max(self.budget_cap, old // 2 // 16 * 16)
        self._fresh_prefill = 0
        base, per_token = self._step_base_s(), self._per_token_s()
        reason = (f"measured steps: {per_token * 1e3:.3f} ms per prompt token next to {base * 1e3:.1f} ms of "
                  f"decodes; {self.budget_cap} tokens fit {cfg.step_fill:.0%} of the ITL objective "
                  f"{cfg.slo_itl_ms:g} ms")
        if self.budget > self.budget_cap:
            reason += f" (halved at most per cut: {self.budget})"
        return [Decision(now, "max_num_batched_tokens", old, self.budget, reason,
                         {"per_prompt_token_s": per_token, "decode_step_s": base, "budget_cap": self.budget_cap,
                          "prefill_samples": len(self._prefill_steps), "decode_samples": len(self._decode_step_s),
                          "step_fill": cfg.step_fill, "slo_itl_ms": cfg.slo_itl_ms})]

    def _cut_for_slow_step(self, now: float) -> list[Decision]:
        gap, prefill = self._slow_step
        self._slow_step = None
        old, obj = self.budget, self.config.slo_itl_ms
        # The chunk that ran was at most min(budget, prefill); aim that far under the objective
        # (in whole blocks of 16: the step time grows about linearly with the chunk).
        target = min(old, prefill) * obj / (gap * 1e3) * 0.9
        new = max(self.config.min_budget, min(old - 16, int(target) // 16 * 16))
        if new >= old:
            return []
        self.budget = new
        self._itl_ceiling, self._ceiling_age = min(old, self._itl_ceiling or old), 0
        over = sum(g * 1e3 > obj for g, _ in self._held_steps)
        return [Decision(now, "max_num_batched_tokens", old, new,
                         f"a step with a {prefill}-token prefill chunk held a decoding request {gap * 1e3:.1f} ms "
                         f"> ITL objective {obj:g} ms ({over} of the last {len(self._held_steps)} prefill steps "
                         f"that held a decode were over it)",
                         {"step_gap_s": gap, "prefill_tokens": prefill, "slo_itl_ms": obj,
                          "itl_margin": self.config.itl_margin, "steps_over": over,
                          "steps_seen": len(self._held_steps)})]

    def _spec_costs(self) -> tuple[float, float, str] | None:
        """(plain decode step s, s one draft token adds, where from) at the window's batch."""
        batch = statistics.fmean(self._spec_batch) if self._spec_batch else 1.0
        c = self.config.step_costs
        if c is not None:
            return c.step_time(0, round(batch)), c.per_prefill_token_s, c.source
        per_token = self._per_token_s()
        if per_token is None:
            return None
        return percentile(self._decode_step_s, 50), per_token, "live steps"

    def _decide_speculation(self, now: float) -> list[Decision]:
        cfg = self.config
        if not cfg.steer_speculation or self._spec_shadow.window.tokens < cfg.spec_window_tokens:
            return []
        costs = self._spec_costs()
        if costs is None:
            return []  # no step measured yet: keep counting
        plain, per_token, source = costs
        w = self._spec_shadow.take()
        batch = statistics.fmean(self._spec_batch) if self._spec_batch else 1.0
        proposed, accepted = self._spec_measured
        self._spec_batch, self._spec_measured = [], (0, 0)
        a, cov = w.acceptance, w.coverage
        k, best = best_k(a, cov, cfg.spec_max_k, batch, plain, per_token)
        current = speedup(a, cov, self.spec_k, batch, plain, per_token) if self.spec_method else 1.0
        figures = {"window_tokens": w.tokens, "acceptance": a, "draft_coverage": cov,
                   "acceptance_rate": w.acceptance_rate, "mean_batch": batch, "plain_step_s": plain,
                   "per_draft_token_s": per_token, "costs": source, "best_k": k, "best_speedup": best,
                   "current_speedup": current, "spec_on_speedup": cfg.spec_on_speedup,
                   "spec_off_speedup": cfg.spec_off_speedup}
        if proposed:
            figures["engine_acceptance_rate"] = accepted / proposed
        self.last_spec = figures
        why = (f"n-gram acceptance {a:.0%} per position over {w.tokens} output tokens, drafts at {cov:.0%} of "
               f"steps, batch {batch:.1f}, plain step {plain * 1e3:.1f} ms + {per_token * 1e3:.3f} ms per draft "
               f"token: modelled speedup {best:.2f}x at k={k}")
        out: list[Decision] = []
        if self.spec_method is None and best >= cfg.spec_on_speedup:
            out.append(Decision(now, "speculative_method", None, "ngram", f"{why} >= {cfg.spec_on_speedup}x", figures))
            self.spec_method = "ngram"
            if k != self.spec_k:
                out.append(Decision(now, "num_speculative_tokens", self.spec_k, k, why, figures))
                self.spec_k = k
        elif self.spec_method is not None and best < cfg.spec_off_speedup:
            out.append(Decision(now, "speculative_method", self.spec_method, None,
                                f"{why} < {cfg.spec_off_speedup}x: verification does not pay", figures))
            self.spec_method = None
        elif self.spec_method == "ngram" and k != self.spec_k and best > current * 1.05:
            out.append(Decision(now, "num_speculative_tokens", self.spec_k, k,
                                f"{why}, against {current:.2f}x at k={self.spec_k}", figures))
            self.spec_k = k
        return out

    # ---- the engine ----------------------------------------------------------------------------

    def apply(self, engine, changes: list[Change]) -> None:
        """Make `changes` real on an LLMEngine, between two steps (on its thread)."""
        for c in changes:
            if c.knob == "enable_prefix_caching":
                # Safe at any step boundary: sequences admitted while it was off hash their full
                # blocks from the start at their next commit; while off nothing is looked up or
                # registered, and cached blocks keep their contents until they are taken.
                engine.kv.enable_prefix_caching = bool(c.new)
            elif c.knob == "max_num_batched_tokens":
                engine.scheduler.max_num_batched_tokens = int(c.new)
                # The budget is cut for the decodes a chunk delays; a step with none keeps the
                # configured budget (Scheduler.prefill_only_budget): a burst into an idle engine is
                # prefilled as the defaults would, not over more steps that then hold its decodes.
                engine.scheduler.prefill_only_budget = self.configured_budget
                # Every running sequence must still decode every step: the batch fits the budget.
                engine.scheduler.max_num_seqs = min(self.max_num_seqs, int(c.new))
            elif c.knob == "speculative_method":
                engine.set_speculation(c.new, self.spec_k if c.new else None)
            elif c.knob == "num_speculative_tokens" and self.spec_method is not None:
                engine.set_speculation(self.spec_method, int(c.new))

    def on_step(self, outputs, stats, now: float) -> None:
        """StepObserver: turn the step's outputs and stats into records, decide, apply."""
        q, h = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.record_prefix(q - self._last_prefix[0], h - self._last_prefix[1])
        self._last_prefix = (q, h)
        max_gap = 0.0
        for out in outputs:
            new = max((len(c.delta_token_ids) for c in out.outputs), default=0)
            rid = out.request_id
            last = self._last_token_time.get(rid)
            if out.outputs and (new or out.finished):
                self.record_output(rid, out.prompt_token_ids if last is None and new else None,
                                   out.outputs[0].delta_token_ids, out.finished)
            if new:
                if last is None:
                    if out.metrics is not None and out.metrics.first_token_time is not None:
                        self.record_ttft(out.metrics.first_token_time - out.metrics.arrival_time)
                    self.record_prompt(out.prompt_token_ids)
                else:
                    gaps = self._gaps.setdefault(rid, [])
                    gaps += [(now - last) / new] * new
                    max_gap = max(max_gap, (now - last) / new)
                    if len(gaps) >= self.config.itl_chunk:
                        self.record_itl(percentile(self._gaps.pop(rid), self.config.itl_percentile))
                self._last_token_time[rid] = now
            if out.finished:
                self._last_token_time.pop(rid, None)
                gaps = self._gaps.pop(rid, None)
                if gaps:
                    self.record_itl(percentile(gaps, self.config.itl_percentile))
                if out.outputs:
                    self.record_finished(out.prompt_token_ids + out.outputs[0].token_ids)
        # Each sequence of the step contributes one token plus its prefill chunk's others (a
        # speculative verification's proposals count too; they only make the cut a little larger).
        self.record_step(max_gap, stats.last_step_num_tokens - stats.last_step_num_seqs,
                         stats.last_step_time_s)
        p, a = getattr(stats, "spec_num_proposed_tokens", 0), getattr(stats, "spec_num_accepted_tokens", 0)
        self.record_spec_measured(p - self._last_spec[0], a - self._last_spec[1], stats.last_step_num_seqs)
        self._last_spec = (p, a)
        changes = self.decide(now)
        if changes and self._engine is not None:
            self.apply(self._engine, changes)

    def on_abort(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            self._last_token_time.pop(rid, None)
            self._gaps.pop(rid, None)
            self._spec_shadow.finish(rid)

    # ---- Prometheus --------------------------------------------------------------------------

    def collector(self, model_name: str):
        """A prometheus_client Collector of the autopilot's knobs, windows and changes."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        autopilot = self

        class _Collector:
            def collect(self):
                def gauge(name: str, doc: str, value: float | None):
                    g = GaugeMetricFamily(name, doc, labels=["model_name"])
                    if value is not None:
                        g.add_metric([model_name], value)
                    return g

                yield gauge("tessera:autopilot_prefix_caching", "1 while the autopilot keeps prefix caching on.",
                            float(autopilot.prefix_caching))
                yield gauge("tessera:autopilot_max_num_batched_tokens", "The token budget the autopilot set.",
                            autopilot.budget)
                yield gauge("tessera:autopilot_window_hit_rate", "Prefix hit rate of the last decision window "
                            "(the shadow index's while caching is off).", autopilot.last_hit_rate)
                yield gauge("tessera:autopilot_window_itl_seconds", "p90 over the last window's requests of their "
                            f"p{autopilot.config.itl_percentile:g} inter-token gap.", autopilot.last_itl)
                yield gauge("tessera:autopilot_window_p90_ttft_seconds", "p90 TTFT of the last window.",
                            autopilot.last_p90_ttft)
                yield gauge("tessera:autopilot_speculative_tokens", "The n-gram k the autopilot set (0: speculation "
                            "off).", float(autopilot.spec_k if autopilot.spec_method else 0))
                spec = autopilot.last_spec or {}
                yield gauge("tessera:autopilot_window_spec_acceptance", "Per-position n-gram acceptance of the last "
                            "speculation window (the shadow replay of all outputs).", spec.get("acceptance"))
                yield gauge("tessera:autopilot_window_spec_speedup", "Modelled decode speedup of the best k in the "
                            "last speculation window.", spec.get("best_speedup"))
                c = CounterMetricFamily("tessera:autopilot_decisions", "Settings the autopilot changed, by knob "
                                        "(each one a Decision record with its reason and figures).",
                                        labels=["model_name", "knob"])
                counts: dict[str, int] = {}
                for ch in list(autopilot.changes):
                    counts[ch.knob] = counts.get(ch.knob, 0) + 1
                for knob in KNOBS:
                    c.add_metric([model_name, knob], counts.get(knob, 0))
                yield c

        return _Collector()
