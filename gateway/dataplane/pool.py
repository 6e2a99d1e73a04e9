"""The replicas of one local upstream and how one of them is chosen for a request.

Choice: among replicas that are up (per the supervisor) and not ejected, prefer the one that
rendezvous hashing assigns to the request's prefix key — so requests sharing a system prompt
land where the engine's prefix cache already holds it — as long as it is not overloaded
(its outstanding requests <= the minimum over candidates + ``slack``); otherwise take the one
with the fewest outstanding requests. Rendezvous (highest random weight) hashing moves only the
keys of a replica that leaves, and needs no ring to rebuild.

Ejection: ``eject_after_failures`` consecutive failed attempts eject a replica for
``eject_cooldown_s``; after the cool-down a probe of its ``/health`` readmits it (or starts a
new cool-down). A replica without a probe path (a remote endpoint) is readmitted half-open
instead: the next request is the probe, and one more failure ejects it again. Everything here
runs on the event loop thread; no locks are needed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("portico.gateway.pool")


@dataclass(eq=False)
class Replica:
    """One engine process as the data plane sees it.

    ``client`` is its one HTTP client (health probes, readiness); ``transport`` is that client's
    own transport — the same connection pool — which the proxy calls directly on the hot path,
    skipping the client's per-request cookie, redirect and URL-merging work (the engine sets no
    cookies and sends no redirects). ``timeouts`` are httpx's timeout extension for those calls.
    """

    name: str
    client: httpx.AsyncClient
    transport: httpx.AsyncBaseTransport | None = None
    timeouts: dict[str, float | None] = field(default_factory=dict)
    up: bool = False  # set by the supervisor (process running and ready)
    probe_path: str | None = "/health"  # None: readmitted half-open after the cool-down
    outstanding: int = 0
    consecutive_failures: int = 0
    ejected: bool = False
    ejected_until: float = 0.0
    key: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        self.key = self.name.encode()

    @property
    def available(self) -> bool:
        return self.up and not self.ejected


def _weight(prefix_key: bytes, replica_key: bytes) -> int:
    digest = hashlib.blake2b(prefix_key + b"\x00" + replica_key, digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Pool:
    """Replicas serving one model; ``pick`` chooses, ``record_*`` feed ejection."""

    def __init__(
        self,
        name: str,
        replicas: list[Replica],
        *,
        slack: int = 2,
        eject_after_failures: int = 3,
        eject_cooldown_s: float = 5.0,
        on_eject: Callable[[Replica], None] | None = None,
    ) -> None:
        self.name = name
        self.replicas = replicas
        self.slack = slack
        self.eject_after_failures = eject_after_failures
        self.eject_cooldown_s = eject_cooldown_s
        self.on_eject = on_eject
        self._next = 0  # rotates ties between equally loaded replicas

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.available]

    def pick(self, prefix_key: bytes | None, exclude: tuple[Replica, ...] = ()) -> Replica | None:
        """The replica for this attempt, or None when no replica can take it."""
        candidates = [r for r in self.replicas if r.available and r not in exclude]
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        least = min(r.outstanding for r in candidates)
        if prefix_key:
            preferred = max(candidates, key=lambda r: _weight(prefix_key, r.key))
            if preferred.outstanding <= least + self.slack:
                return preferred
        self._next += 1
        n = len(candidates)
        for i in range(n):
            replica = candidates[(self._next + i) % n]
            if replica.outstanding == least:
                return replica
        return candidates[0]  # unreachable: some candidate holds the minimum

    def record_success(self, replica: Replica) -> None:
        replica.consecutive_failures = 0

    def record_failure(self, replica: Replica) -> None:
        replica.consecutive_failures += 1
        if replica.consecutive_failures >= self.eject_after_failures and not replica.ejected:
            self.eject(replica)

    def eject(self, replica: Replica) -> None:
        replica.ejected = True
        replica.ejected_until = time.monotonic() + self.eject_cooldown_s
        log.warning("replica %s ejected for %.1f s", replica.name, self.eject_cooldown_s)
        if self.on_eject is not None:
            self.on_eject(replica)

    async def probe_ejected(self) -> None:
        """Probe each ejected replica whose cool-down is over; readmit the ones that answer."""
        now = time.monotonic()
        for replica in self.replicas:
            if not replica.ejected or replica.ejected_until > now or not replica.up:
                continue
            if replica.probe_path is None:  # half-open: one more failure ejects it again
                replica.ejected = False
                replica.consecutive_failures = max(0, self.eject_after_failures - 1)
                log.info("replica %s readmitted half-open after its cool-down", replica.name)
                continue
            try:
                resp = await replica.client.get(replica.probe_path, timeout=2.0)
                ok = resp.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                replica.ejected = False
                replica.consecutive_failures = 0
                log.info("replica %s readmitted after a successful probe", replica.name)
            else:
                replica.ejected_until = time.monotonic() + self.eject_cooldown_s

    async def run_prober(self, interval_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.probe_ejected()
