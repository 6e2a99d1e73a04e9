"""Which metric names Portico's code exports, and which ones a PromQL expression reads.

``exported_sample_names`` builds the real registries (the engine server's ``ServerMetrics`` and
the gateway's ``GatewayMetrics`` with admission and the abuse guard registered on it, as
``create_app`` does) and derives every sample name Prometheus will see from each family's type
(a counter ``x`` is scraped as ``x_total``, a histogram as ``x_bucket``/``x_sum``/``x_count``).
Nothing here lists a metric by hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry

# Series Prometheus makes itself rather than scraping them.
PROMETHEUS_SERIES = frozenset({"up", "ALERTS", "ALERTS_FOR_STATE"})

SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name a scrape of ``registry`` can contain."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type])
    return names


def engine_registry() -> CollectorRegistry:
    from engine.server.metrics import ServerMetrics
    from engine.stats import EngineStats

    return ServerMetrics("catalog", 2048, EngineStats).registry


def gateway_registry() -> CollectorRegistry:
    import redis.asyncio

    from gateway.admission.abuse import AbuseGuard, AbuseSettings
    from gateway.admission.admission import Admission, AdmissionSettings
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    # Built as Gateway.start builds them: on the gateway's own registry. Neither connects here.
    Admission(redis.asyncio.Redis(), AdmissionSettings(), registry=metrics.registry)
    AbuseGuard("redis://127.0.0.1:1/0", AbuseSettings(), registry=metrics.registry)
    return metrics.registry


def exported_sample_names() -> set[str]:
    return sample_names(engine_registry()) | sample_names(gateway_registry())


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
        "e",
    }
)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (function names, labels and keywords left out)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _GROUPING.sub("", text)
    names = set()
    for match in _IDENT.finditer(text):
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before in ".$":  # 1e3, 0.5, Grafana's $variables
            continue
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function call
        if match.group(0).lower() in _KEYWORDS:
            continue
        names.add(match.group(0))
    return names


_LABEL_VALUES = re.compile(r"label_values\(\s*([^,{)\s]+)")


def template_query_names(query: str) -> set[str]:
    """Metric names a Grafana variable query reads: ``label_values(metric, label)``."""
    return set(_LABEL_VALUES.findall(query))


def names_in(expressions: Iterable[str]) -> set[str]:
    found: set[str] = set()
    for expr in expressions:
        found |= promql_metric_names(expr)
    return found
