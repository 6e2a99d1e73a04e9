"""Engine replicas found by DNS: one replica per address a name resolves to.

On Kubernetes the engines run in their own pods behind a headless Service, whose name resolves
to one A (or AAAA) record per ready pod. :class:`DNSDiscovery` re-resolves that name every
``interval_s`` and keeps a :class:`~gateway.fleet.pool.Pool`'s replicas equal to the
answer: a new address becomes a replica (up once its ``/ready`` answers 200), a vanished one is
dropped and its client closed. Between resolutions each replica's ``/ready`` is probed, so an
engine that starts draining stops taking requests before its DNS record goes away.

A name that does not exist (a headless Service with no ready pod answers NXDOMAIN) empties the
pool; any other resolver failure keeps the last answer (a DNS hiccup must not take every
replica away). Runs on the event loop; no locks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import httpx
from pydantic import BaseModel, ConfigDict, Field

from gateway.fleet.pool import Pool, Replica

log = logging.getLogger("portico.gateway.discovery")

PROBE_TIMEOUT_S = 2.0


class DiscoverySpec(BaseModel):
    """``engines[].discovery``: where an engine pool's replicas are found, instead of started."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dns: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")  # e.g. portico-engine-headless
    port: int = Field(ge=1, le=65535)
    interval_s: float = Field(default=10.0, gt=0, le=3600)


async def resolve_addresses(host: str, port: int) -> list[str] | None:
    """The distinct addresses ``host`` resolves to, in the resolver's order; [] when the name
    does not exist; None when the resolver failed otherwise (try again later)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        log.warning("resolving %s failed: %s", host, exc)
        return None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class DNSDiscovery:
    """Keeps ``pool.replicas`` equal to the addresses of ``spec.dns`` (see the module doc).

    ``make_replica(name, address, port)`` builds a replica with its own client; replicas are
    named ``<pool>-<address>`` (the ``engine`` label of ``/metrics/engines``).
    """

    def __init__(
        self,
        pool: Pool,
        spec: DiscoverySpec,
        make_replica: Callable[[str, str, int], Replica],
        resolve: Callable[[str, int], Awaitable[list[str] | None]] = resolve_addresses,
    ) -> None:
        self.pool = pool
        self.spec = spec
        self.make_replica = make_replica
        self.resolve = resolve
        self._by_address: dict[str, Replica] = {}

    async def refresh(self) -> None:
        """Resolve once, add and drop replicas, then probe every replica's readiness."""
        addresses = await self.resolve(self.spec.dns, self.spec.port)
        if addresses is not None:
            for address in addresses:
                if address not in self._by_address:
                    name = f"{self.pool.name}-{address}"
                    replica = self.make_replica(name, address, self.spec.port)
                    self._by_address[address] = replica
                    self.pool.replicas.append(replica)
                    log.info("engine replica %s found at %s", name, self.spec.dns)
            for address in [a for a in self._by_address if a not in addresses]:
                replica = self._by_address.pop(address)
                self.pool.replicas.remove(replica)
                replica.up = False
                log.info("engine replica %s left %s", replica.name, self.spec.dns)
                await replica.client.aclose()
        await asyncio.gather(*(self._probe(r) for r in self._by_address.values()))

    @staticmethod
    async def _probe(replica: Replica) -> None:
        try:
            response = await replica.client.get("/ready", timeout=PROBE_TIMEOUT_S)
            ready = response.status_code == 200
        except httpx.HTTPError:
            ready = False
        if ready != replica.up:
            log.info("engine replica %s is %s", replica.name, "ready" if ready else "not ready")
        replica.up = ready

    async def run(self) -> None:
        """Refresh every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.spec.interval_s)
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop discovery for good
                log.exception("engine discovery of %s failed", self.spec.dns)

    async def aclose(self) -> None:
        for replica in self._by_address.values():
            await replica.client.aclose()
        self._by_address.clear()
