"""``/metrics/engines`` merging: every sample gets its replica's ``engine`` label and each family
appears once, parsed back by Prometheus's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.engine_metrics import relabel

EXPOSITION = """# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
# HELP vllm:prompt_tokens_total Prompt tokens.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} 7.0
# HELP vllm:e2e_request_latency_seconds Latency.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 2.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 3.5
"""


def test_two_replicas_merge_into_one_family_each_labelled_by_engine() -> None:
    text = relabel(
        [("tiny-0", EXPOSITION), ("tiny-1", EXPOSITION.replace("} 2.0", "} 5.0"))]
    ).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE vllm:num_requests_running ") == 1
    running = {s.labels["engine"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"tiny-0": 2.0, "tiny-1": 5.0}
    counter = families["vllm:prompt_tokens"]
    assert counter.type == "counter"
    assert {s.labels["engine"] for s in counter.samples} == {"tiny-0", "tiny-1"}
    hist = families["vllm:e2e_request_latency_seconds"]
    assert hist.type == "histogram" and len(hist.samples) == 8
    assert all(s.labels["model_name"] == "m" for s in hist.samples)


def test_no_engines_is_an_empty_exposition() -> None:
    assert relabel([]) == b""
