"""deploy/compose/prometheus: promtool accepts the config and the rules, the rules' unit tests
pass (each alert fires after its `for:` and not before), every alert is well-formed and tested,
and every metric the rules read is one Portico's code exports.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml
from edge_nginx import REPO_ROOT
from metric_catalog import PROMETHEUS_SERIES, exported_sample_names, names_in

PROMETHEUS = REPO_ROOT / "deploy" / "compose" / "prometheus"
REQUIRED_ALERTS = {
    "PorticoKVCacheHigh",
    "PorticoQueueBacklog",
    "PorticoTTFTHigh",
    "PorticoHighErrorRate",
    "PorticoEngineDown",
    "PorticoRedisDown",
    "PorticoGatewayDown",
    "PorticoNoGateway",
}


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, cwd=PROMETHEUS
    )


def test_promtool_accepts_config_and_rules(promtool: str) -> None:
    result = _promtool(promtool, "check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(REQUIRED_ALERTS)} rules found" in result.stdout


def test_alert_unit_tests_pass(promtool: str) -> None:
    result = _promtool(promtool, "test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rejects_a_broken_rule(promtool: str, tmp_path: Any) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "g",
                        "rules": [
                            {"alert": "Broken", "expr": "sum(rate(vllm:num_preemptions_total[5m])"}
                        ],
                    }
                ]
            }
        )
    )
    assert _promtool(promtool, "check", "rules", str(bad)).returncode != 0


def test_every_alert_is_well_formed(rules: list[dict[str, Any]]) -> None:
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert set(names) == REQUIRED_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert rule["for"].endswith("m"), rule["alert"]  # never on a single bad sample


def test_every_alert_has_a_unit_test_that_fires_it(rules: list[dict[str, Any]]) -> None:
    doc = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())
    fired = {
        case["alertname"]
        for test in doc["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == {r["alert"] for r in rules}


def test_rules_read_only_metrics_the_code_exports(rules: list[dict[str, Any]]) -> None:
    unknown = names_in(r["expr"] for r in rules) - exported_sample_names() - PROMETHEUS_SERIES
    assert not unknown, f"alert rules read metrics nothing exports: {sorted(unknown)}"


def test_alerted_jobs_are_scraped(rules: list[dict[str, Any]]) -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {c["job_name"] for c in config["scrape_configs"]}
    assert "portico-gateway" in jobs
    for rule in rules:
        if 'job="' in rule["expr"]:
            job = rule["expr"].split('job="', 1)[1].split('"', 1)[0]
            assert job in jobs, rule["alert"]
