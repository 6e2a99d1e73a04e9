"""``GET /metrics/engines``: every ready local engine replica's ``/metrics``, relabelled.

Engines listen on Unix sockets that Prometheus cannot reach, so the gateway fetches each ready
replica's exposition over that replica's own client, adds ``engine="<replica name>"`` to every
sample and merges families of the same name (one ``# HELP``/``# TYPE`` block each, as the text
format requires). A replica that does not answer, or answers something that does not parse, is
left out of that scrape (logged at debug level); the others are still served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Sequence

import httpx
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.fleet.pool import Replica

log = logging.getLogger("portico.gateway.engine_metrics")

SCRAPE_TIMEOUT_S = 5.0


class _Families:
    """A collector over already merged families (what ``generate_latest`` iterates)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def relabel(expositions: Sequence[tuple[str, str]]) -> bytes:
    """Merge ``(replica name, exposition text)`` pairs into one exposition, labelled by engine.

    Raises ``ValueError`` when a text does not parse (callers drop that replica first by
    parsing each on its own; see :func:`scrape_engines`).
    """
    merged: dict[str, Metric] = {}
    for engine, text in expositions:
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            into.samples.extend(
                Sample(s.name, {**s.labels, "engine": engine}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    return generate_latest(_Families(merged.values()))


async def fetch_exposition(replica: Replica) -> tuple[str, str] | None:
    """``(replica name, its /metrics text)``, or None when it does not answer or parse."""
    try:
        response = await replica.client.get("/metrics", timeout=SCRAPE_TIMEOUT_S)
        if response.status_code != 200:
            log.debug("engine %s /metrics answered %d", replica.name, response.status_code)
            return None
        text = response.text
        list(text_string_to_metric_families(text))  # parses: kept
    except (httpx.HTTPError, OSError, ValueError) as exc:
        log.debug("engine %s /metrics failed: %s", replica.name, exc)
        return None
    return replica.name, text


async def scrape_engines(replicas: Iterable[Replica]) -> bytes:
    """Fetch every ready replica's metrics concurrently and relabel them (see module doc)."""
    results = await asyncio.gather(*(fetch_exposition(r) for r in replicas if r.up))
    return relabel([r for r in results if r is not None])
