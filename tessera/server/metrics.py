"""Prometheus metrics under the `tessera:` prefix, named as vLLM users expect, and the per-request log line.

`ServerMetrics` is the AsyncLLMEngine's step observer: the engine thread reports every step's
outputs, and this turns them into latency histograms (TTFT, inter-token latency, TPOT, e2e,
queue time), batch-size histograms and a finished-request counter (aborted requests, e.g. a
client that disconnected, count there with finished_reason="abort", as in vLLM). Engine-wide totals and
gauges (tokens, preemptions, running/waiting, KV usage, prefix cache queries/hits/hit rate,
evicted/demoted/promoted blocks, swapped blocks, the host tier, speculative draft and accepted tokens) are read from the engine's
stats snapshot at scrape time, so they are always exact. Each app has its own registry, so
tests can run several apps in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tessera.outputs import RequestOutput

logger = logging.getLogger("tessera.requests")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                          1.0, 2.5, 5.0)
# finish_reason values a request can end with (the label of tessera:request_success_total).
FINISH_REASONS = ("stop", "length", "abort")
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


@dataclass
class _Tracked:
    last_token_time: float | None = None


class ServerMetrics:
    """Prometheus metrics of one server (one engine), in a registry of its own."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        # The *_created samples only clutter the page (vLLM drops them too); this switch is process-wide.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("tessera:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              _LATENCY_BUCKETS)
        self.itl = histogram("tessera:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             _TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("tessera:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("tessera:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS)
        self.queue = histogram("tessera:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill = histogram("tessera:request_prefill_time_seconds", "First scheduled to first token.",
                                 _LATENCY_BUCKETS)
        self.decode = histogram("tessera:request_decode_time_seconds", "First token to last token.",
                                _LATENCY_BUCKETS)
        self.prompt_tokens = histogram("tessera:request_prompt_tokens", "Prompt tokens per finished request.",
                                       _TOKEN_COUNT_BUCKETS)
        self.generation_tokens = histogram("tessera:request_generation_tokens",
                                           "Generated tokens per finished request (all n choices).",
                                           _TOKEN_COUNT_BUCKETS)
        self.iteration_num_seqs = histogram("tessera:iteration_num_seqs", "Sequences in one engine step.",
                                            _BATCH_BUCKETS)
        # Histogram names carry no _total (Prometheus keeps that suffix for counters).
        self.iteration_tokens = histogram("tessera:iteration_tokens", "Tokens computed in one engine step.",
                                          _BATCH_BUCKETS)
        self._success = Counter("tessera:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # every declared family exports a sample, 0 before the first request
            self._success.labels(model_name, reason)
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ... of this process.
        ProcessCollector(registry=self.registry)
        self._tracked: dict[str, _Tracked] = {}
        self._stats_fn: Callable | None = None
        self.registry.register(_EngineStatsCollector(self))

    def bind_stats(self, stats_fn: Callable) -> None:
        """Where scrape-time gauges and totals come from (AsyncLLMEngine.stats)."""
        self._stats_fn = stats_fn

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- StepObserver (engine thread) ----------------------------------------------------------

    def on_step(self, outputs: list[RequestOutput], stats, now: float) -> None:
        if stats.last_step_num_seqs:
            self.iteration_num_seqs.observe(stats.last_step_num_seqs)
            self.iteration_tokens.observe(stats.last_step_num_tokens)
        for out in outputs:
            self._observe_output(out, now)

    def on_abort(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            tracked = self._tracked.pop(rid, None)
            self._success.labels(self.model_name, "abort").inc()
            logger.info("request %s aborted (%s)", rid, "while generating" if tracked else "before its first token")

    def _observe_output(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            tracked = self._tracked[out.request_id] = _Tracked()
        new_tokens = max((len(c.delta_token_ids) for c in out.outputs), default=0)
        if new_tokens:
            if tracked.last_token_time is None:
                if m is not None and m.first_token_time is not None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                # Several tokens in the first step (speculative decoding): the rest are inter-token.
                extra = new_tokens - 1
                last = m.first_token_time if m is not None and m.first_token_time is not None else now
            else:
                extra = new_tokens
                last = tracked.last_token_time
            if extra:
                gap = (now - last) / extra
                for _ in range(extra):
                    self.itl.observe(gap)
            tracked.last_token_time = now
        if out.finished:
            del self._tracked[out.request_id]
            self._observe_finished(out, now)

    def _observe_finished(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        reason = out.outputs[0].finish_reason if out.outputs else "stop"
        self._success.labels(self.model_name, reason or "stop").inc()
        num_prompt = len(out.prompt_token_ids)
        num_out = sum(len(c.token_ids) for c in out.outputs)
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        self.prompt_tokens.observe(num_prompt)
        self.generation_tokens.observe(num_out)
        if m is None:
            logger.info("request %s finished (%s): prompt %d tokens, output %d tokens", out.request_id, reason,
                        num_prompt, num_out)
            return
        finished = m.finished_time if m.finished_time is not None else now
        e2e = finished - m.arrival_time
        self.e2e.observe(e2e)
        queue = ttft = None
        if m.first_scheduled_time is not None:
            queue = m.first_scheduled_time - m.arrival_time
            self.queue.observe(queue)
        if m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            if m.first_scheduled_time is not None:
                self.prefill.observe(m.first_token_time - m.first_scheduled_time)
            self.decode.observe(finished - m.first_token_time)
            if longest > 1:
                self.tpot.observe((finished - m.first_token_time) / (longest - 1))
        logger.info(
            "request %s finished (%s): queue %s, ttft %s, e2e %.3fs, prompt %d tokens, output %d tokens%s",
            out.request_id, reason, _secs(queue), _secs(ttft), e2e, num_prompt, num_out,
            f", {m.num_cached_tokens} prefix-cached" if m.num_cached_tokens else "",
        )


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


class _EngineStatsCollector(Collector):
    """Gauges and running totals read from the engine's stats snapshot when Prometheus scrapes."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        fn = self.metrics._stats_fn
        if fn is None:
            return
        s = fn()
        name = self.metrics.model_name

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        yield gauge("tessera:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("tessera:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("tessera:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", s.kv_cache_usage)
        yield gauge("tessera:num_free_kv_blocks", "Free KV cache blocks.", s.num_free_blocks)
        yield gauge("tessera:num_total_kv_blocks", "Usable KV cache blocks.", s.num_total_blocks)
        yield counter("tessera:prompt_tokens", "Prompt tokens received.", s.prompt_tokens_total)
        yield counter("tessera:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("tessera:num_preemptions", "Sequence preemptions.", s.num_preemptions)
        yield counter("tessera:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("tessera:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield gauge("tessera:prefix_cache_hit_rate", "Prefix cache hits / queries since start, by tokens (0..1).",
                    s.prefix_cache_hit_rate)
        yield counter("tessera:prefix_cache_evicted_blocks", "Cached KV blocks the device pool reused for new content.",
                      s.num_evicted_blocks)
        yield counter("tessera:prefix_cache_demoted_blocks",
                      "Evicted cached KV blocks copied to the host tier instead of dropped.", s.num_demoted_blocks)
        yield counter("tessera:prefix_cache_promoted_blocks",
                      "Host-tier KV blocks copied back to the device for a prefix hit.", s.num_promoted_blocks)
        yield counter("tessera:kv_blocks_swapped_out", "KV blocks of preempted sequences copied to the host tier.",
                      s.num_swapped_out_blocks)
        yield counter("tessera:kv_blocks_swapped_in", "KV blocks of resumed sequences copied back from the host tier.",
                      s.num_swapped_in_blocks)
        yield gauge("tessera:num_requests_swapped", "Sequences whose KV blocks sit in the host tier.",
                    s.num_swapped_seqs)
        yield gauge("tessera:host_kv_cache_usage_perc",
                    "Fraction of host-tier KV blocks held by swapped sequences (0..1; 0 without --swap-space).",
                    1.0 - s.num_host_free_blocks / s.num_host_total_blocks if s.num_host_total_blocks else 0.0)
        yield gauge("tessera:host_kv_cached_blocks", "Demoted prefix-cache blocks held in the host tier now.",
                    s.num_host_cached_blocks)
        # vLLM's names, without its `_total` (the exposition adds it): 0 while speculation is off.
        yield counter("tessera:spec_decode_num_draft_tokens", "Draft tokens proposed for verification.",
                      s.spec_num_proposed_tokens)
        yield counter("tessera:spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.",
                      s.spec_num_accepted_tokens)
