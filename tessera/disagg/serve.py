"""The OpenAI server over the router: the same app, with disaggregation metrics added."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tessera.config import EngineConfig
from tessera.disagg.cluster import ClusterConfig, create_router
from tessera.disagg.router import DisaggRouter


def create_disagg_app(config: EngineConfig, cluster: ClusterConfig, served_model_name: str | None = None,
                      api_key: str | None = None, limits=None, allowed_origins: list[str] | None = None):
    from tessera.server.app import build_app
    from tessera.server.metrics import ServerMetrics

    name = served_model_name or config.model
    metrics = ServerMetrics(name)
    router = create_router(config, cluster, observer=metrics)
    app = build_app(router, metrics, served_model_name=name, api_key=api_key, model_root=config.model,
                    limits=limits, allowed_origins=allowed_origins)
    metrics.registry.register(DisaggCollector(router, name))
    return app


class DisaggCollector:
    """KV transfers (count, tokens, seconds by stage), worker health and failovers, at scrape time."""

    def __init__(self, router: DisaggRouter, model_name: str) -> None:
        self.router, self.model_name = router, model_name

    def collect(self):
        r, labels = self.router, ["model_name"]
        totals = r.transfer_totals
        count = CounterMetricFamily("tessera:kv_transfers", "KV handoffs from prefill to decode workers", labels=labels)
        count.add_metric([self.model_name], r.num_transfers)
        yield count
        tokens = CounterMetricFamily("tessera:kv_transfer_tokens", "tokens whose K/V were transferred", labels=labels)
        tokens.add_metric([self.model_name], totals.num_tokens)
        yield tokens
        seconds = CounterMetricFamily("tessera:kv_transfer_seconds",
                                      "seconds spent on KV handoffs: export (prefill worker), import (decode "
                                      "worker), handoff (router: prefill's event to decode's import done)",
                                      labels=["model_name", "stage"])
        for stage, value in (("export", totals.export_s), ("import", totals.import_s), ("handoff", totals.handoff_s)):
            seconds.add_metric([self.model_name, stage], value)
        yield seconds
        alive = GaugeMetricFamily("tessera:workers_alive", "workers in service", labels=["model_name", "role"])
        for role in ("prefill", "decode", "replica"):
            alive.add_metric([self.model_name, role],
                             sum(1 for h in r.workers.values() if h.role == role and h.name in r.alive))
        yield alive
        deaths = CounterMetricFamily("tessera:worker_failures", "workers found dead", labels=labels)
        deaths.add_metric([self.model_name], r.num_worker_deaths)
        yield deaths
        retried = CounterMetricFamily("tessera:requests_retried", "requests moved off a dead worker", labels=labels)
        retried.add_metric([self.model_name], r.num_retried_requests)
        yield retried
