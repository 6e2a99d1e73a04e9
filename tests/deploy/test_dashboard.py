"""deploy/compose/grafana: the dashboard is well-formed Grafana JSON, its PromQL parses, it
reads only metric names Portico's code exports (built registries and a running gateway's
scrape), and it shows what operators need: TTFT, TPOT, throughput, queue, KV cache, prefix-cache
hit rate, per-tenant traffic and 429s.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from edge_nginx import REPO_ROOT
from metric_catalog import (
    SAMPLE_SUFFIXES,
    exported_sample_names,
    names_in,
    promql_metric_names,
    template_query_names,
)
from prometheus_client.parser import text_string_to_metric_families

GRAFANA = REPO_ROOT / "deploy" / "compose" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "portico.json"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def _targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for p in dashboard["panels"] for t in p.get("targets", [])]


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for t in _targets(dashboard)]


def _variable_queries(dashboard: dict[str, Any]) -> list[str]:
    out = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "portico-overview"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"
            for target in panel["targets"]:
                assert target["expr"].strip() and target["refId"]


def test_provisioning_points_at_the_dashboard_and_datasource(dashboard: dict[str, Any]) -> None:
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    datasource_var = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert datasource_var["current"]["value"] == source["uid"]
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/portico.yml").read_text())
    compose = (REPO_ROOT / "deploy/compose/docker-compose.yml").read_text()
    path = providers["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{path}:ro" in compose


def test_dashboard_reads_only_metrics_the_code_exports(dashboard: dict[str, Any]) -> None:
    used = names_in(_expressions(dashboard))
    for query in _variable_queries(dashboard):
        used |= template_query_names(query)
    unknown = used - exported_sample_names()
    assert not unknown, f"the dashboard reads metrics nothing exports: {sorted(unknown)}"


def test_name_check_would_catch_a_wrong_name() -> None:
    expr = 'sum by (le) (rate(vllm:time_to_first_token_bucket{model_name=~"$model"}[5m]))'
    assert promql_metric_names(expr) == {"vllm:time_to_first_token_bucket"}
    assert "vllm:time_to_first_token_bucket" not in exported_sample_names()


def test_metric_name_extraction_skips_functions_labels_and_numbers() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, model_name) (rate(a_bucket{x="y(z)"}[5m]))) '
        "/ on (model_name) group_left b_total * 1e3 > bool 0.5 and absent(up == 1)"
    )
    assert promql_metric_names(expr) == {"a_bucket", "b_total", "up"}


def test_dashboard_shows_what_operators_need(dashboard: dict[str, Any]) -> None:
    exprs = _expressions(dashboard)
    used = names_in(exprs)
    assert {
        "vllm:time_to_first_token_seconds_bucket",  # TTFT
        "vllm:inter_token_latency_seconds_bucket",  # TPOT
        "vllm:generation_tokens_total",  # throughput
        "vllm:num_requests_waiting",  # queue
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "portico_gateway_requests_total",
    } <= used
    assert any("by (tenant)" in e and "portico_gateway_requests_total" in e for e in exprs)
    assert any('status="429"' in e and "by (tenant)" in e for e in exprs)


def _as_prometheus_expr(expr: str) -> str:
    # Grafana's variables, as Grafana substitutes them before Prometheus sees the query.
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$[a-z_]+", ".*", expr)


def test_dashboard_promql_parses(dashboard: dict[str, Any], promtool: str, tmp_path: Path) -> None:
    rules = [
        {"record": f"dashboard:panel_{i}", "expr": _as_prometheus_expr(e)}
        for i, e in enumerate(_expressions(dashboard))
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_gateway_names_are_on_a_running_gateway(
    dashboard: dict[str, Any], gateway: Any
) -> None:
    scraped: set[str] = set()
    for family in text_string_to_metric_families(gateway.metrics()):
        scraped.update(family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type])
    wanted = {n for n in names_in(_expressions(dashboard)) if n.startswith("portico_")}
    assert wanted and wanted <= scraped, sorted(wanted - scraped)


def test_engine_metrics_reach_prometheus_through_the_gateway(gateway: Any) -> None:
    import httpx

    r = httpx.get(gateway.url + "/metrics/engines", timeout=10)
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    running = families["vllm:num_requests_running"]
    assert {s.labels.get("engine") for s in running.samples} == {"gated-0"}
