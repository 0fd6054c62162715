"""The dashboard's figures: snapshots of the server's own Prometheus registry, and the windowed
series drawn from them.

`snapshot(registry)` reads every sample the /metrics page would show (summed over labels other
than a histogram's `le`), so the dashboard and a Prometheus scrape can never disagree about a
total. `StatsHistory` keeps the last minutes of snapshots in a ring and turns them into the
chart series: rates and hit rates over a sliding window of snapshots, latency quantiles from the
window's histogram bucket increments with Prometheus' own `histogram_quantile` interpolation, so
a Grafana panel over `rate(..._bucket[w])` shows the same curve.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

# Histograms whose quantiles the dashboard draws: series key -> metric family name.
LATENCY_HISTOGRAMS = {
    "ttft": "tessera:time_to_first_token_seconds",
    "itl": "tessera:inter_token_latency_seconds",
}


@dataclass
class Snapshot:
    """One read of the registry: sample name -> value (labels summed), and histogram buckets."""

    time: float  # wall clock, seconds since the epoch
    values: dict[str, float] = field(default_factory=dict)
    # family name -> [(upper bound, cumulative count)], ascending, +Inf last
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)


def snapshot(registry: CollectorRegistry, now: float | None = None) -> Snapshot:
    snap = Snapshot(time.time() if now is None else now)
    for family in registry.collect():
        per_le: dict[float, float] = {}
        for s in family.samples:
            if s.name.endswith("_bucket") and "le" in s.labels:
                le = float(s.labels["le"])
                per_le[le] = per_le.get(le, 0.0) + s.value
            else:
                snap.values[s.name] = snap.values.get(s.name, 0.0) + s.value
        if per_le:
            snap.buckets[family.name] = sorted(per_le.items())
    return snap


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets: linear
    interpolation inside the bucket that holds the rank; the highest finite bound when the rank
    falls in +Inf; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower_bound
            if count == lower_count:
                return upper
            return lower_bound + (upper - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper, count
    return lower_bound


def bucket_increase(new: list[tuple[float, float]], old: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    """The observations between two reads of one histogram, bucket by bucket."""
    if not old:
        return list(new)
    before = dict(old)
    return [(le, count - before.get(le, 0.0)) for le, count in new]


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def totals(snap: Snapshot) -> dict[str, float]:
    """The figures the dashboard prints as numbers, keyed by the /metrics sample they equal."""
    names = (
        "tessera:num_requests_running", "tessera:num_requests_waiting", "tessera:num_requests_swapped",
        "tessera:kv_cache_usage_perc", "tessera:num_free_kv_blocks", "tessera:num_total_kv_blocks",
        "tessera:host_kv_cache_usage_perc", "tessera:host_kv_cached_blocks",
        "tessera:prompt_tokens_total", "tessera:generation_tokens_total", "tessera:num_preemptions_total",
        "tessera:request_success_total", "tessera:requests_rejected_total", "tessera:request_timeouts_total",
        "tessera:prefix_cache_queries_total", "tessera:prefix_cache_hits_total",
        "tessera:spec_decode_num_draft_tokens_total", "tessera:spec_decode_num_accepted_tokens_total",
    )
    return {n: snap.get(n) for n in names if n in snap.values}


def derive_point(cur: Snapshot, base: Snapshot) -> dict[str, float | None]:
    """The chart figures at `cur`, over the window since `base` (gauges are read at `cur`)."""
    dt = cur.time - base.time

    def increase(name: str) -> float:
        return max(0.0, cur.get(name) - base.get(name))

    point: dict[str, float | None] = {"t": cur.time}
    for key, family in LATENCY_HISTOGRAMS.items():
        window = bucket_increase(cur.buckets.get(family, []), base.buckets.get(family))
        for q in (50, 99):
            v = histogram_quantile(q / 100, window)
            point[f"{key}_p{q}_ms"] = None if v is None else v * 1e3
    point["output_tokens_per_s"] = increase("tessera:generation_tokens_total") / dt if dt > 0 else None
    point["running"] = cur.get("tessera:num_requests_running")
    point["waiting"] = cur.get("tessera:num_requests_waiting")
    total = cur.get("tessera:num_total_kv_blocks")
    point["kv_blocks_used"] = total - cur.get("tessera:num_free_kv_blocks")
    point["kv_usage"] = cur.get("tessera:kv_cache_usage_perc")
    point["host_kv_usage"] = cur.get("tessera:host_kv_cache_usage_perc")
    point["host_kv_cached_blocks"] = cur.get("tessera:host_kv_cached_blocks")
    point["prefix_hit_rate"] = _ratio(increase("tessera:prefix_cache_hits_total"),
                                      increase("tessera:prefix_cache_queries_total"))
    point["spec_acceptance"] = _ratio(increase("tessera:spec_decode_num_accepted_tokens_total"),
                                      increase("tessera:spec_decode_num_draft_tokens_total"))
    point["preemptions"] = increase("tessera:num_preemptions_total")
    point["rejected"] = increase("tessera:requests_rejected_total")
    return point


class StatsHistory:
    """The last `capacity` snapshots and the series over them (window of `window` snapshots)."""

    def __init__(self, capacity: int = 300, window: int = 5) -> None:
        self.window = window
        self._snaps: deque[Snapshot] = deque(maxlen=capacity)

    def add(self, snap: Snapshot) -> None:
        self._snaps.append(snap)

    def __len__(self) -> int:
        return len(self._snaps)

    def series(self) -> dict[str, list]:
        """Column-wise points, one per snapshot after the first: {"t": [...], "ttft_p50_ms": [...], ...}."""
        snaps = list(self._snaps)
        columns: dict[str, list] = {}
        for i in range(1, len(snaps)):
            point = derive_point(snaps[i], snaps[max(0, i - self.window)])
            for key, value in point.items():
                columns.setdefault(key, []).append(value)
        return columns
