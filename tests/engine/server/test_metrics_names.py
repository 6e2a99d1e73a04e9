"""The engine's /metrics carries the series autoscalers and fleet routers key on, under vLLM's
exact names and types (KEDA, prometheus-adapter, llm-d and Dynamo read these names as-is)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics import ServerMetrics
from engine.stats import EngineStats

# name -> (Prometheus type, the EngineStats reading it must carry)
AUTOSCALER_SERIES = {
    "vllm:num_requests_waiting": ("gauge", 7.0),  # num_waiting + num_swapped
    "vllm:num_requests_running": ("gauge", 3.0),
    "vllm:kv_cache_usage_perc": ("gauge", 0.25),
    "vllm:prefix_cache_queries": ("counter", 640.0),
    "vllm:prefix_cache_hits": ("counter", 480.0),
}


def exposition(stats: EngineStats) -> dict[str, tuple[str, dict[str, float]]]:
    text = ServerMetrics("smollm2", 2048, lambda: stats).render().decode()
    return {
        f.name: (
            f.type,
            {s.name: s.value for s in f.samples if s.labels["model_name"] == "smollm2"},
        )
        for f in text_string_to_metric_families(text)
    }


def test_autoscaler_series_have_vllm_names_types_and_the_engines_values() -> None:
    stats = EngineStats(
        num_running=3,
        num_waiting=5,
        num_swapped=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=640,
        prefix_cache_hits=480,
    )
    families = exposition(stats)
    for name, (kind, value) in AUTOSCALER_SERIES.items():
        assert name in families, f"{name} missing from /metrics"
        got_kind, samples = families[name]
        assert got_kind == kind, name
        # counters are exposed with vLLM's `_total` sample name
        sample = name + "_total" if kind == "counter" else name
        assert samples[sample] == value, name


def test_autoscaler_series_exist_on_an_idle_engine() -> None:
    """A scaler reading an idle engine sees zeros, not an absent series (KEDA treats an
    absent series as an error and falls back)."""
    families = exposition(EngineStats())
    for name, (kind, _) in AUTOSCALER_SERIES.items():
        sample = name + "_total" if kind == "counter" else name
        assert families[name][1][sample] == 0.0
