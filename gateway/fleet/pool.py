"""The replicas of one local upstream and how one of them is chosen for a request.

Choice: among replicas that are up (per the supervisor) and not ejected, prefer the one that
rendezvous hashing assigns to the request's prefix key — so requests sharing a system prompt
land where the engine's prefix cache already holds it — as long as it is not overloaded
(its outstanding requests <= the minimum over candidates + ``slack``); otherwise take the one
with the fewest outstanding requests. Rendezvous (highest random weight) hashing moves only the
keys of a replica that leaves, and needs no ring to rebuild.

Replica policy (``replica_policy`` in policies/routing.yaml): ``least_loaded`` is the choice
above; ``round_robin`` rotates over the available replicas whatever their load;
``prefix_aware`` takes the replica where this request's first token is expected soonest, plus
the prefill it would recompute there that another replica caches. Per replica: the prompt
tokens it would compute there (its prompt less the longest prefix that replica's engine caches,
per a :class:`~gateway.fleet.prefix_index.PrefixIndex` fed by the engines' block events),
the work ahead of it there as the engine's fair scheduler orders it, and the decode rows that
share every step (:func:`~gateway.fleet.replica_load.estimate_wait`, from this gateway's
live :class:`~gateway.fleet.replica_load.ReplicaLoad` of each replica and what the engine
reports beyond it: other gateways' waiting requests, its running batch, its LoRA slots). The
recomputation is counted once more because a spill costs the fleet that prefill, not only this
request: so a tenant stays on the holder of its prompt while other tenants' work runs there,
and spills to a second replica (which then caches it too) when its own requests pile up on the
holder, or the holder has more tenants' long prefills sharing its steps than the other replica
by more than the recomputation, or the holder's queue outweighs about two prompts. Equal scores
prefer the longer cached prefix, then rotate. It falls back to ``least_loaded`` when the request
brings no tokens or no replica's index entry is fresh. (Earlier versions: the longest prefix
within ``slack`` of the least load sent a tenant to a cold replica one request past the slack,
and its hit rate equalled ``least_loaded``'s; then the least queue x average uncached tokens,
which counted no decode rows and no tenant, kept every tenant on its holder whatever piled up
behind it there, and spilled by an average skewed by the first cold prompts.)

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
from typing import Literal

import httpx

from gateway.fleet.prefix_index import PrefixIndex, RouteTokens
from gateway.fleet.replica_load import ADAPTER_LOAD_TOKENS, Lease, ReplicaLoad, estimate_wait

log = logging.getLogger("portico.gateway.pool")

ReplicaPolicy = Literal["prefix_aware", "least_loaded", "round_robin"]
# prefix_aware: a replica whose KV cache is this full gets no prefix credit (it is about to
# evict, and a new request there may preempt one running).
KV_FULL = 0.95
# prefix_aware: the least a request queued by others (beyond this gateway's) is costed at, in
# prompt tokens (a fully cached one still takes a small prefill of its last block).
MIN_QUEUED_TOKENS = 16.0
QUEUED_EWMA = 0.2  # weight of the newest routed request in a replica's per-request cost


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
    load: ReplicaLoad = field(default_factory=ReplicaLoad, repr=False)
    consecutive_failures: int = 0
    ejected: bool = False
    ejected_until: float = 0.0
    key: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        self.key = self.name.encode()

    @property
    def available(self) -> bool:
        return self.up and not self.ejected

    @property
    def outstanding(self) -> int:
        """Requests this gateway has sent here and not yet closed (its leases)."""
        return self.load.outstanding

    @outstanding.setter
    def outstanding(self, value: int) -> None:
        self.load.outstanding = value


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
        replica_policy: ReplicaPolicy = "least_loaded",
        index: PrefixIndex | None = None,
    ) -> None:
        self.name = name
        self.replica_policy = replica_policy
        self.index = index
        self.replicas = replicas
        self.slack = slack
        self.eject_after_failures = eject_after_failures
        self.eject_cooldown_s = eject_cooldown_s
        self.on_eject = on_eject
        self._next = 0  # rotates ties between equally loaded replicas
        # prefix_aware: per replica name, uncached prompt tokens of a request routed there
        # recently (an average): what one queued request there is costed at
        self.queued_cost: dict[str, float] = {}

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.available]

    def available_clients(self) -> list[tuple[str, httpx.AsyncClient]]:
        """(name, client) of the replicas up now: what a prefix index feeder polls."""
        return [(r.name, r.client) for r in self.replicas if r.available]

    def pick(
        self,
        prefix_key: bytes | None,
        exclude: tuple[Replica, ...] = (),
        tokens: RouteTokens | None = None,
    ) -> Replica | None:
        """The replica for this attempt, or None when no replica can take it."""
        candidates = [r for r in self.replicas if r.available and r not in exclude]
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        if self.replica_policy == "round_robin":
            self._next += 1
            return candidates[self._next % len(candidates)]
        if self.replica_policy == "prefix_aware" and tokens is not None and self.index is not None:
            chosen = self._pick_by_prefix(candidates, tokens, self.index)
            if chosen is not None:
                return chosen
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

    def _pick_by_prefix(
        self, candidates: list[Replica], tokens: RouteTokens, index: PrefixIndex
    ) -> Replica | None:
        """The replica with the least expected wait plus recomputation (see the module
        docstring); equal scores prefer the longer cached prefix, then rotate. None when no
        index entry is fresh (the caller routes by load)."""
        prompt = len(tokens.token_ids)
        waits: list[float] = []
        uncached: list[int] = []
        any_fresh = False
        for replica in candidates:
            entry = index.fresh(replica.name)
            cached = 0
            foreign = 0.0
            rows = None
            adapter = 0.0
            if entry is not None:
                any_fresh = True
                if entry.kv_cache_usage < KV_FULL:  # a nearly full cache is about to evict
                    cached = min(index.cached_tokens(replica.name, tokens) or 0, prompt)
                # Requests waiting there beyond ours (other gateways'; the engine's count is a
                # poll old), each costed at the uncached tokens recently routed there.
                beyond = max(0, entry.num_waiting - replica.load.num_prefilling)
                per_request = self.queued_cost.get(replica.name, prompt - cached)
                foreign = beyond * max(per_request, MIN_QUEUED_TOKENS)
                rows = entry.num_running
                if tokens.model in entry.lora_ids and tokens.model not in entry.lora_resident:
                    adapter = ADAPTER_LOAD_TOKENS
            uncached.append(prompt - cached)
            wait = estimate_wait(
                replica.load, tokens.tenant, prompt - cached,
                foreign_prefill=foreign, num_decoding=rows,
            )  # fmt: skip
            waits.append(wait + adapter)
        if not any_fresh:
            return None
        least_uncached = min(uncached)
        score = [(waits[i] + uncached[i] - least_uncached, uncached[i]) for i in range(len(waits))]
        best = min(score)
        tied = [i for i in range(len(candidates)) if score[i] == best]
        self._next += 1
        chosen = candidates[tied[self._next % len(tied)]]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("prefix_aware chose %s; scores %s", chosen.name, score)
        return chosen

    def acquire(self, replica: Replica, tokens: RouteTokens | None = None) -> Lease:
        """Send a request to ``replica``: count it there until the lease is released, charged
        (for prefix_aware) with the prompt tokens it will compute there, note its prompt as
        cached there (routed, until the engine confirms it), and name the request already
        computing some of its uncached blocks there (``Lease.follows``)."""
        index = self.index
        if tokens is None or self.replica_policy != "prefix_aware" or index is None:
            return replica.load.lease(0, None)
        prompt = len(tokens.token_ids)
        cached = index.cached_tokens(replica.name, tokens)
        prefill = prompt - min(cached or 0, prompt)
        if cached is None:  # no fresh entry: nothing known of its blocks there
            return replica.load.lease(prefill, tokens.tenant)
        old = self.queued_cost.get(replica.name, float(prefill))
        self.queued_cost[replica.name] = old + QUEUED_EWMA * (prefill - old)
        computing = replica.load.computing
        blocks: list[bytes] = []
        follows = None
        for block_hash in index.block_hashes(replica.name, tokens):
            if index.is_stored(replica.name, block_hash):
                continue
            leader = computing.get(block_hash)
            if leader is not None:
                follows = leader
            else:
                blocks.append(block_hash)
        index.note_routed(replica.name, tokens)
        return replica.load.lease(prefill, tokens.tenant, tuple(blocks), follows)

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
