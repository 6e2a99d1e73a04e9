"""OpenTelemetry tracing, shared by the gateway and the engine: off unless ``OTEL_*`` says so.

Tracing is on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``; ``none``
keeps it off) or, with that variable unset, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set; ``OTEL_SDK_DISABLED=true`` turns it off. The
rest is the SDK's own reading of the standard variables: the OTLP exporter (HTTP/protobuf)
takes ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers, timeout, compression), the sampler
``OTEL_TRACES_SAMPLER``/``_ARG``, the batch processor ``OTEL_BSP_*``, the resource
``OTEL_RESOURCE_ATTRIBUTES``; ``OTEL_SERVICE_NAME`` names the service (default
``portico-gateway`` / ``portico-engine``).

The SDK and the exporter are the ``otel`` extra (``pip install 'portico[otel]'``); without them
a request to trace is logged and ignored. Nothing here sets OpenTelemetry's global provider:
each process builds its own and hands it to the code that makes spans.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("portico.tracing")

KNOWN_EXPORTERS = ("otlp", "console")


def tracing_enabled(env: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces (see the module docstring)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER")
    if exporters is not None:
        return any(n.strip().lower() not in ("", "none") for n in exporters.split(","))
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def provider_from_env(env: Mapping[str, str], service_name: str) -> Any | None:
    """A ``TracerProvider`` exporting as the environment says, or None when tracing is off
    (or the ``otel`` extra is missing, which is logged)."""
    if not tracing_enabled(env):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning("tracing asked for; opentelemetry-sdk is missing: pip install 'portico[otel]'")
        return None
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    for name in names:
        if name == "otlp":
            protocol = env.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
            )
            if protocol and protocol != "http/protobuf":
                log.warning("OTLP protocol %r is not shipped; exporting http/protobuf", protocol)
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError:
                log.warning("the OTLP exporter is missing: pip install 'portico[otel]'")
                continue
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name not in ("", "none"):
            log.warning("unknown OTEL_TRACES_EXPORTER %r (known: %s)", name, KNOWN_EXPORTERS)
    log.info("tracing on: service %s, exporters %s", resource.attributes["service.name"], names)
    return provider
