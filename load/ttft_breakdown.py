"""Where a streamed request's first token went: its TTFT cut into parts from real traces.

The benches that run a real ``portico serve`` turn tracing on (OpenTelemetry, OTLP/HTTP) with
:class:`TraceCollector` as the receiver, send each request they want explained with their own
sampled ``traceparent`` (and the others with an unsampled one, so only those are recorded),
and afterwards cut each one's client-side TTFT into parts from the gateway's and the engine's
spans of its trace (docs/observability.md names the spans):

- ``to_gateway``: the client's send to the gateway's request span (the client's loop, the
  socket, the gateway's loop picking it up);
- ``gateway``: authenticate, route, admit: the gateway span's start to its upstream attempt;
- ``to_engine``: the attempt's start to the engine's arrival stamp (the HTTP hop, the engine
  server's parsing, chat template and tokenization);
- ``step_in_flight``: arrival to the end of the step the engine was running then (a step
  cannot be cut; ``inflight_step`` is that step's whole length);
- ``to_schedule``: from there to first scheduled (the engine's ``queue`` span less the step in
  flight: between steps, and any further steps it waited; ``steps_to_schedule``, 1: none);
- ``prefill``: first scheduled to the engine's first token (the step(s) that computed the
  prompt; ``steps_to_first_token``, 1: one step);
- ``relay``: the engine's first token to the client's (detokenized, framed as SSE by the
  engine, relayed by the gateway, read by the client).

All stamps are wall-clock nanoseconds of one machine, so the parts add up to the TTFT.
"""

from __future__ import annotations

import http.server
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PARTS = ("to_gateway", "gateway", "to_engine", "step_in_flight", "to_schedule", "prefill", "relay")


@dataclass
class Traced:
    """One request to explain: its trace id, when the client sent it and its TTFT (s)."""

    trace_id: str
    sent_ns: int
    ttft_s: float = 0.0


def traceparent(sampled: bool) -> tuple[str, str]:
    """A new W3C ``traceparent`` header: (trace id in hex, header value)."""
    trace_id = secrets.token_hex(16)
    flags = "01" if sampled else "00"
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"


class TraceCollector:
    """An OTLP/HTTP traces receiver on 127.0.0.1: keeps every span it is sent, by trace id.
    Thread-safe (the HTTP server's threads add, the bench reads)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self._lock = threading.Lock()
        self._spans: dict[str, list[tuple[str, Any]]] = {}
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector._add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _add(self, request: Any) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        key = span.trace_id.hex()
                        self._spans.setdefault(key, []).append((service, span))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def env(self) -> dict[str, str]:
        """What a traced process needs: this receiver, a short export delay."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }

    def spans(self, trace_id: str) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self._spans.get(trace_id, ()))

    def __enter__(self) -> TraceCollector:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind) if kind else None
    return out


def breakdown(traced: Traced, spans: Sequence[tuple[str, Any]]) -> dict[str, float] | None:
    """``traced``'s TTFT in parts (ms) plus the engine's step counts; None when a span is
    missing (not exported yet, or the request failed)."""
    found: dict[str, Any] = {}
    for service, span in spans:
        if service == "portico-gateway" and span.kind == 2 and "gateway" not in found:  # SERVER
            found["gateway"] = span
        elif service == "portico-gateway" and span.name == "upstream attempt":
            found.setdefault("attempt", span)
        elif service == "portico-engine" and span.name in ("queue", "execute"):
            found[span.name] = span
    if len(found) < 4:
        return None
    execute = _attributes(found["execute"])
    engine_ttft = execute.get("gen_ai.server.time_to_first_token")
    if engine_ttft is None:
        return None
    queue = found["queue"]
    queued = _attributes(queue)
    first_token_ns = queue.start_time_unix_nano + int(engine_ttft * 1e9)
    client_first_ns = traced.sent_ns + int(traced.ttft_s * 1e9)
    left_ns = int(queued.get("portico.engine.step_in_flight_left_s", 0.0) * 1e9)
    stamps = [
        traced.sent_ns,
        found["gateway"].start_time_unix_nano,
        found["attempt"].start_time_unix_nano,
        queue.start_time_unix_nano,
        queue.start_time_unix_nano + left_ns,
        queue.end_time_unix_nano,
        first_token_ns,
        client_first_ns,
    ]
    out = {part: (b - a) / 1e6 for part, a, b in zip(PARTS, stamps, stamps[1:], strict=False)}
    out["ttft"] = traced.ttft_s * 1000
    out["inflight_step"] = 1000 * queued.get("portico.engine.step_in_flight_s", 0.0)
    out["steps_to_schedule"] = float(queued.get("portico.engine.steps_to_schedule", -1))
    out["steps_to_first_token"] = float(execute.get("portico.engine.steps_to_first_token", -1))
    return out


def collect(
    collector: TraceCollector, traced: Iterable[Traced], timeout_s: float = 30.0
) -> list[dict[str, float]]:
    """Each traced request's breakdown, waiting up to ``timeout_s`` for its spans to arrive
    (the processes export in batches); requests whose spans never came are left out."""
    pending = list(traced)
    done: list[dict[str, float]] = []
    deadline = time.monotonic() + timeout_s
    while pending:
        left = []
        for t in pending:
            parts = breakdown(t, collector.spans(t.trace_id))
            if parts is None:
                left.append(t)
            else:
                done.append(parts)
        pending = left
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return done


@dataclass
class Summary:
    """Per part: the median and the mean (ms; step counts as counts) over the requests."""

    num_requests: int = 0
    median: dict[str, float] = field(default_factory=dict)
    mean: dict[str, float] = field(default_factory=dict)
    rows: list[dict[str, float]] = field(default_factory=list)


def summarize(rows: Sequence[dict[str, float]]) -> Summary:
    import statistics

    summary = Summary(num_requests=len(rows), rows=list(rows))
    if not rows:
        return summary
    for key in (*PARTS, "ttft", "inflight_step", "steps_to_schedule", "steps_to_first_token"):
        values = [r[key] for r in rows]
        summary.median[key] = statistics.median(values)
        summary.mean[key] = statistics.fmean(values)
    return summary
