"""The gateway's Prometheus metrics, in a registry of its own (served at ``/metrics``).

Names start with ``portico_gateway_`` (money: ``portico_spend_``). Label values are bounded
by configuration (tenants, models, tiers, replicas, limits), never by request content.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class GatewayMetrics:
    """Every gateway metric, registered on ``self.registry``; one instance per app."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "portico_gateway_"
        self.requests = Counter(
            p + "requests",
            "Requests answered, by tenant, model, route tier and HTTP status",
            ["tenant", "model", "tier", "status"],
            registry=r,
        )
        self.latency = Histogram(
            p + "request_duration_seconds",
            "Time from arrival to the last byte sent",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            p + "time_to_first_byte_seconds",
            "Time from arrival to the first body byte sent",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            p + "overhead_seconds",
            "Time spent in the gateway itself (x-portico-overhead-ms), queueing included",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            p + "retries",
            "Attempts retried before the first byte, by upstream and reason",
            ["upstream", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            p + "ejections",
            "Replicas ejected after consecutive failures",
            ["upstream", "replica"],
            registry=r,
        )
        self.fallbacks = Counter(
            p + "fallbacks",
            "Requests sent on to a fallback tier before the first byte, by tier and reason",
            ["from_tier", "to_tier", "reason"],
            registry=r,
        )
        self.usage_counted = Counter(
            p + "usage_counted",
            "Answers without upstream usage whose output the gateway counted, by rule",
            ["model", "source"],
            registry=r,
        )
        self.rate_limited = Counter(
            p + "rate_limited",
            "Requests refused by admission, by the limit that refused them",
            ["limit"],
            registry=r,
        )
        self.engine_restarts = Counter(
            p + "engine_restarts",
            "Engine processes restarted by the supervisor",
            ["engine"],
            registry=r,
        )
        self.spend = Counter(
            "portico_spend_usd",
            "Spend at the models' prices (USD), by tenant and model",
            ["tenant", "model"],
            registry=r,
        )
        self.in_flight = Gauge(p + "requests_in_flight", "Requests being handled", registry=r)
        self.engine_up = Gauge(
            p + "engine_up",
            "1 when the engine replica is running and ready",
            ["engine"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
