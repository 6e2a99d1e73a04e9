"""Prometheus metrics of one served model, with vLLM's names so dashboards carry over.

Each :class:`ServerMetrics` owns its :class:`~prometheus_client.CollectorRegistry` (no global
registry): two apps in one process never share a series. Gauges and the engine's cumulative
counters (prefix cache, preemptions) are read from :class:`~engine.stats.EngineStats` at scrape
time; per-request counters and histograms are fed by :class:`RequestTracker` as outputs arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput
from engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ["model_name"]

# vLLM's buckets, so histograms line up with existing dashboards.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


def token_buckets(max_value: int) -> list[float]:
    """1-2-5 buckets up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


class EngineStatsCollector(Collector):
    """Exposes an :class:`EngineStats` snapshot, taken at scrape time, as vLLM's series."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        labels = [self.model_name]
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                stats.num_running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed (queued or preempted).",
                stats.num_waiting + stats.num_swapped,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                stats.kv_cache_usage,
            ),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(labels, float(value))
            yield gauge
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in number of queried tokens.",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in number of cached tokens.",
                stats.prefix_cache_hits,
            ),
            ("vllm:num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions),
            # a busy engine's mean step time is elapsed time over steps (load/ benches read it)
            ("portico_engine_steps", "Engine steps run (schedule + forward).", stats.num_steps),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(labels, float(value))
            yield counter
        yield from _spec_decode_counters(stats, labels)
        yield from _tenant_metrics(stats, labels)
        if stats.max_lora:  # vLLM's info gauge: the value is the time, the labels the adapters
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            info.add_metric(
                [
                    str(stats.max_lora),
                    ",".join(stats.running_lora_adapters),
                    ",".join(stats.waiting_lora_adapters),
                ],
                time.time(),
            )
            yield info


def _tenant_metrics(stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
    """Portico's per-tenant series (engine/tenancy.py); absent until a tenant is seen."""
    if not stats.tenants:
        return
    tokens = CounterMetricFamily(
        "portico_engine_tenant_tokens",
        "Tokens scheduled for a tenant (kind: prompt = prefill, generation = decode).",
        labels=[*LABELS, "tenant", "kind"],
    )
    gauges = [
        GaugeMetricFamily(name, doc, labels=[*LABELS, "tenant"])
        for name, doc in (
            ("portico_engine_tenant_requests_waiting", "A tenant's requests waiting."),
            ("portico_engine_tenant_requests_running", "A tenant's requests running."),
            ("portico_engine_tenant_kv_blocks", "KV cache blocks a tenant's requests hold."),
            (
                "portico_engine_tenant_slot_share",
                "Running slots the fair policy owes a tenant now (its slot share).",
            ),
        )
    ]
    for t in stats.tenants:
        tokens.add_metric([*labels, t.name, "prompt"], float(t.num_prompt_tokens))
        tokens.add_metric([*labels, t.name, "generation"], float(t.num_generation_tokens))
        for gauge, value in zip(
            gauges,
            (t.num_waiting, t.num_running, t.num_kv_blocks, t.num_slot_share),
            strict=True,
        ):
            gauge.add_metric([*labels, t.name], float(value))
    yield tokens
    yield from gauges


def _spec_decode_counters(stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters; absent when the engine does not speculate."""
    if not stats.spec_decode_num_accepted_tokens_per_pos:
        return
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
         stats.spec_decode_num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
         stats.spec_decode_num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
         stats.spec_decode_num_accepted_tokens),
    ):  # fmt: skip
        counter = CounterMetricFamily(name, doc, labels=LABELS)
        counter.add_metric(labels, float(value))
        yield counter
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=[*LABELS, "position"],
    )
    for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        per_pos.add_metric([*labels, str(position)], float(value))
    yield per_pos


class ServerMetrics:
    """The metrics of one served model; ``render()`` is the ``/metrics`` body."""

    def __init__(
        self, model_name: str, max_model_len: int, read_stats: Callable[[], EngineStats]
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=reg
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=reg
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of finished completions, by finish reason.",
            LABELS + ["finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            LABELS,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            LABELS,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        token_hist = token_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed, per request.",
            LABELS,
            buckets=token_hist,
            registry=reg,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed, per request.",
            LABELS,
            buckets=token_hist,
            registry=reg,
        )
        # Prompts taken as the gateway carried their token ids, not rendered or encoded here
        # (portico/contract.py "Carried prompt"), by endpoint: chat or completions.
        self.prompts_carried = Counter(
            "portico:prompts_carried",
            "Number of prompts whose token ids the gateway carried (no render or encode here).",
            LABELS + ["endpoint"],
            registry=reg,
        )
        reg.register(EngineStatsCollector(model_name, read_stats))
        for endpoint in ("chat", "completions"):
            self.prompts_carried.labels(model_name, endpoint)
        for family in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.request_prompt_tokens,
            self.request_generation_tokens,
        ):
            family.labels(model_name)  # every series exists from the first scrape
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self._bind_token_series()

    def _bind_token_series(self) -> None:
        """The series a streamed token feeds, looked up once: ``labels()`` takes a lock and
        builds a key on every call, and a stream would call these once a token."""
        self.generation_tokens_series = self.generation_tokens.labels(self.model_name)
        self.ttft_series = self.ttft.labels(self.model_name)
        self.itl_series = self.itl.labels(self.model_name)

    # Called with a request's final output (engine/server/tracing.py records its spans);
    # None: nothing is called.
    on_finished: Callable[[RequestOutput], None] | None = None

    def track(self, num_prompt_tokens: int) -> RequestTracker:
        """Start tracking one engine request (its prompt counts as processed from now)."""
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        return RequestTracker(self, num_prompt_tokens)

    def carried(self, endpoint: str) -> None:
        """Count one prompt taken as the gateway carried it (``chat`` or ``completions``)."""
        self.prompts_carried.labels(self.model_name, endpoint).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Feeds one request's outputs into the metrics: tokens, TTFT, inter-token gaps, finish.

    Times are the server's ``time.monotonic()`` at the moment each output reaches it, which is
    what a client sees. ``finish()`` is idempotent and records an unfinished request as aborted.
    """

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.start = time.monotonic()
        self.last_token_time: float | None = None
        self.num_generated: dict[int, int] = {}
        self.finish_reasons: dict[int, str] = {}
        self.done = False

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        model = m.model_name
        new_tokens = 0
        for choice in output.outputs:
            new_tokens += len(choice.token_ids_delta)
            self.num_generated[choice.index] = len(choice.token_ids)
            if choice.finish_reason is not None and choice.index not in self.finish_reasons:
                self.finish_reasons[choice.index] = choice.finish_reason
                m.request_success.labels(model, choice.finish_reason).inc()
        if output.finished and m.on_finished is not None:
            m.on_finished(output)
        if new_tokens:
            m.generation_tokens_series.inc(new_tokens)
            if self.last_token_time is None:
                m.ttft_series.observe(now - self.start)
            else:
                m.itl_series.observe(now - self.last_token_time)
            self.last_token_time = now

    def finish(self, num_choices: int) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        model = m.model_name
        for index in range(num_choices):
            if index not in self.finish_reasons:
                self.finish_reasons[index] = "abort"
                m.request_success.labels(model, "abort").inc()
        m.e2e.labels(model).observe(time.monotonic() - self.start)
        m.request_prompt_tokens.labels(model).observe(self.num_prompt_tokens)
        m.request_generation_tokens.labels(model).observe(sum(self.num_generated.values()))
