"""Which local replica holds which prefix blocks, fed by the engines' block events.

Each engine publishes the hashes of the blocks its prefix cache stores and evicts
(engine/kv_events.py, served at ``GET /v1/kv_events`` and ``/v1/kv_events/snapshot``). The
:class:`PrefixIndexFeeder` polls every available replica of a pool on the connection the
gateway already holds to it and keeps a :class:`PrefixIndex`: per replica, the set of hashes
cached there, the sequence number it is exact at, and the engine's load as of that poll.

The gateway computes a request's block hashes exactly as the engine does
(:func:`portico.contract.iter_prefix_block_hashes`: the same token ids, the same
``cache_salt`` the proxy sends, the engine's block size and hash root from its snapshot), so a
match is a real cache hit, never a guess on characters. Each engine process has its own root,
so hashes are computed per replica, lazily, stopping at the first block that replica lacks:
the cost is the matched prefix, not the prompt times the replicas.

Freshness is judged by the replica's answers, not by our poll cadence: an entry is trusted
until polls of that replica have failed (an error, a refusal, or no answer within
``stale_after_s``) for ``stale_after_s``. A gateway starved of CPU (or paused) that comes back
after the bound still routes on what the replicas last told it (a block cached then is very
likely cached now; a miss costs one prefill), where an age-since-last-poll rule sent every
request of that moment by load. Each replica is polled by its own task, so a slow replica
delays no other's, and a poll that fails on a pooled connection the engine closed (its
keep-alive expired while we were starved) is retried once at once.
A replica restart (a new ``epoch``), a poll that fell behind the engine's ring (``resync``) or
a gap in sequence numbers drops the entry's hashes and takes a new snapshot; events already
applied (a late or repeated answer) are skipped by sequence number. Memory: at most
``max_hashes`` hashes per replica (an engine never caches more blocks than its pool holds;
an entry past the bound is dropped and rebuilt). Everything runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.body.fields import RequestFields
from portico.contract import iter_prefix_block_hashes

log = logging.getLogger("portico.gateway.prefix_index")

STALE_AFTER_S = 5.0  # ~10 missed polls at the default interval
ROUTED_TTL_S = 10.0  # a routed request's blocks count as cached there this long, unconfirmed
POLL_INTERVAL_S = 0.5
MAX_HASHES_PER_REPLICA = 1 << 20  # 32 MiB of hashes; engines hold far fewer blocks


@dataclass(frozen=True, slots=True)
class RouteTokens:
    """What the prefix scorer needs of a request: its prompt token ids as the engine will see
    them, the ``cache_salt`` the proxy sends with it (None: unsalted), the tenant the engine
    will charge for it (its fair share there), and the model it names: an adapter's name is
    looked up per replica, whose engine numbers its adapters itself (the number is inside the
    block hash); any other name is the base model. ``lora_int_id`` hashes as that adapter
    number on every replica (tests)."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    lora_int_id: int | None = None
    tenant: str | None = None
    model: str | None = None


def route_token_ids(tokenizer: Any, fields: RequestFields) -> list[int] | None:
    """The prompt token ids the engine will hash for this request, or None where the gateway
    cannot be sure of them (tools, shared prefixes, content parts, several prompts, Responses):
    those requests are routed by load. Mirrors engine/server/serving_chat.py (the chat template
    rendered with the generation prompt, then encoded without special tokens) and
    serving_completions.py (a text prompt encoded with them)."""
    if fields.num_tools or fields.shared_prefix is not None:
        return None
    if fields.kind == "chat" and fields.messages:
        if not all(isinstance(m.get("content"), str) for m in fields.messages):
            return None
        counted = fields.chat_prompt_ids  # admission's count rendered this very prompt
        if counted is not None and counted[0] is tokenizer and counted[1] is fields.messages:
            return list(counted[2])
        text = tokenizer.apply_chat_template(
            fields.messages, tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    if fields.kind == "completion":
        prompt = fields.prompt
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt, add_special_tokens=True))
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
    return None


@dataclass(slots=True)
class ReplicaEntry:
    """One replica's cached hashes, exact after event ``next_seq - 1`` of ``epoch``."""

    epoch: str
    next_seq: int
    block_size: int
    hash_root: bytes
    hashes: set[bytes] = field(default_factory=set)
    synced_at: float = 0.0
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    # LoRA adapters the engine serves (name -> its adapter number) and those in its slots now
    lora_ids: dict[str, int] = field(default_factory=dict)
    lora_resident: frozenset[str] = frozenset()
    # hashes of requests routed here and not yet reported stored: hash -> until (monotonic)
    routed: dict[bytes, float] = field(default_factory=dict)
    failing_since: float | None = None  # when the first poll failing since the last answer began


class PrefixIndex:
    """Per replica name, the prefix blocks its engine caches (see the module docstring)."""

    def __init__(
        self,
        *,
        stale_after_s: float = STALE_AFTER_S,
        max_hashes: int = MAX_HASHES_PER_REPLICA,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stale_after_s = stale_after_s
        self.max_hashes = max_hashes
        self.clock = clock
        self.entries: dict[str, ReplicaEntry] = {}

    # -- feeding ---------------------------------------------------------------------------

    def apply_snapshot(self, replica: str, doc: dict[str, Any]) -> None:
        """Replace the replica's entry with a ``/v1/kv_events/snapshot`` answer."""
        hashes = doc["hashes"]
        if len(hashes) > self.max_hashes:
            self.entries.pop(replica, None)
            log.warning("replica %s caches %d blocks, over the index bound", replica, len(hashes))
            return
        self.entries[replica] = ReplicaEntry(
            epoch=doc["epoch"],
            next_seq=int(doc["next_seq"]),
            block_size=int(doc["block_size"]),
            hash_root=bytes.fromhex(doc["hash_root"]),
            hashes={bytes.fromhex(h) for h in hashes},
            synced_at=self.clock(),
        )

    def apply_events(self, replica: str, doc: dict[str, Any]) -> bool:
        """Apply a ``/v1/kv_events`` answer; False when the replica must be resynced (its
        entry is then dropped: no stale hashes are scored)."""
        entry = self.entries.get(replica)
        if entry is None or doc["resync"] or doc["epoch"] != entry.epoch:
            self.entries.pop(replica, None)
            return False
        for event in doc["events"]:
            seq = int(event["seq"])
            hashes = event["hashes"]
            if event["type"] == "cleared":
                if seq >= entry.next_seq:
                    entry.hashes.clear()
                    entry.next_seq = seq + 1
                continue
            for offset, hex_hash in enumerate(hashes):
                if seq + offset < entry.next_seq:
                    continue  # applied already (a repeated or late answer)
                if seq + offset > entry.next_seq:  # a gap: events were lost
                    self.entries.pop(replica, None)
                    return False
                block_hash = bytes.fromhex(hex_hash)
                if event["type"] == "stored":
                    entry.hashes.add(block_hash)
                    entry.routed.pop(block_hash, None)  # confirmed
                else:
                    entry.hashes.discard(block_hash)
                entry.next_seq += 1
        if len(entry.hashes) > self.max_hashes:
            self.entries.pop(replica, None)
            return False
        entry.next_seq = max(entry.next_seq, int(doc["next_seq"]))
        entry.num_waiting = int(doc.get("num_waiting", 0))
        entry.num_running = int(doc.get("num_running", 0))
        entry.kv_cache_usage = float(doc.get("kv_cache_usage", 0.0))
        entry.lora_ids = {str(k): int(v) for k, v in doc.get("lora_adapters", {}).items()}
        entry.lora_resident = frozenset(doc.get("lora_resident", ()))
        entry.synced_at = self.clock()
        entry.failing_since = None
        return True

    def note_poll_failed(self, replica: str, started_at: float) -> None:
        """A poll begun at ``started_at`` got no usable answer: the entry goes stale once
        polls have failed for ``stale_after_s`` from the first such one."""
        entry = self.entries.get(replica)
        if entry is not None and entry.failing_since is None:
            entry.failing_since = started_at
            log.info("kv events of replica %s: a poll failed", replica)

    def forget(self, replica: str) -> None:
        self.entries.pop(replica, None)

    # -- reading ---------------------------------------------------------------------------

    def fresh(self, replica: str) -> ReplicaEntry | None:
        """The replica's entry unless its polls have been failing for ``stale_after_s``."""
        entry = self.entries.get(replica)
        if entry is None:
            return None
        if entry.failing_since is not None and (
            self.clock() - entry.failing_since > self.stale_after_s
        ):
            return None
        return entry

    def cached_tokens(self, replica: str, tokens: RouteTokens) -> int | None:
        """Prompt tokens of the longest prefix cached on the replica (whole blocks), or None
        when its entry is missing or stale."""
        entry = self.fresh(replica)
        if entry is None:
            return None
        now = self.clock()
        matched = 0
        for block_hash in _block_hashes(entry, tokens):
            if block_hash not in entry.hashes and entry.routed.get(block_hash, 0.0) < now:
                break
            matched += 1
        return matched * entry.block_size

    def block_hashes(self, replica: str, tokens: RouteTokens) -> Iterator[bytes]:
        """The request's block hashes as that replica's engine computes them (lazily); none
        when its entry is missing or stale."""
        entry = self.fresh(replica)
        return iter(()) if entry is None else _block_hashes(entry, tokens)

    def is_stored(self, replica: str, block_hash: bytes) -> bool:
        """Whether the replica's engine reported the block stored (not only routed there)."""
        entry = self.entries.get(replica)
        return entry is not None and block_hash in entry.hashes

    def note_routed(self, replica: str, tokens: RouteTokens) -> None:
        """A request with these tokens was sent to the replica: count its prompt blocks as
        cached there for ``ROUTED_TTL_S`` before the engine's events confirm them, so a
        tenant's next request, sent while the first one is still prefilling, follows it (the
        index alone would learn of the blocks only after the prefill and a poll)."""
        entry = self.fresh(replica)
        if entry is None:
            return
        now = self.clock()
        if len(entry.routed) >= self.max_hashes // 4:  # bounded: drop the expired, else all
            entry.routed = {h: t for h, t in entry.routed.items() if t >= now}
            if len(entry.routed) >= self.max_hashes // 4:
                entry.routed.clear()
        until = now + ROUTED_TTL_S
        for block_hash in _block_hashes(entry, tokens):
            if block_hash not in entry.hashes:
                entry.routed[block_hash] = until


def _block_hashes(entry: ReplicaEntry, tokens: RouteTokens) -> Iterator[bytes]:
    """The request's block hashes as that replica's engine computes them (lazily)."""
    lora_int_id = tokens.lora_int_id
    if tokens.model is not None and tokens.model in entry.lora_ids:
        lora_int_id = entry.lora_ids[tokens.model]
    return iter_prefix_block_hashes(
        entry.hash_root, tokens.token_ids, entry.block_size, tokens.cache_salt, lora_int_id
    )


class PrefixIndexFeeder:
    """Polls the replicas of one pool into a :class:`PrefixIndex`.

    ``replicas`` returns (name, client) of the replicas to poll now (the available ones);
    ``client`` is the replica's own :class:`httpx.AsyncClient`. Each replica has at most one
    poll in flight, in its own task, and no poll waits on another replica's. A poll gives up
    after the index's ``stale_after_s`` (an engine busy with a prefill on a loaded machine
    answers late, not never); a replica that does not answer keeps its entry until its polls
    have failed that long; one answering 404 (an engine without prefix caching, or another
    server) is simply never indexed.
    """

    def __init__(
        self,
        index: PrefixIndex,
        replicas: Callable[[], Iterable[tuple[str, httpx.AsyncClient]]],
        *,
        timeout_s: float | None = None,
    ) -> None:
        self.index = index
        self.replicas = replicas
        self.timeout_s = index.stale_after_s if timeout_s is None else timeout_s
        self.failed_polls = 0  # polls with no usable answer, for logs and tests
        self._in_flight: dict[str, asyncio.Task[None]] = {}

    async def poll_once(self) -> None:
        """Poll every replica now (each once, concurrently) and wait for all of them."""
        await asyncio.gather(*(self._poll(name, client) for name, client in self.replicas()))

    async def _poll(self, name: str, client: httpx.AsyncClient) -> None:
        started = self.index.clock()
        for attempt in (1, 2):
            try:
                if await self._fetch(name, client):
                    return
                break  # an answer we cannot use (404, 5xx): no point asking again now
            except httpx.TransportError as exc:  # a pooled connection the engine closed
                log.debug("kv events of %s (attempt %d): %r", name, attempt, exc)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.debug("kv events of %s: %r", name, exc)
                break
        self.failed_polls += 1
        self.index.note_poll_failed(name, started)

    async def _fetch(self, name: str, client: httpx.AsyncClient) -> bool:
        """One poll: the events since the entry's sequence number, else a snapshot. True when
        the index is now exact for the replica."""
        entry = self.index.entries.get(name)
        if entry is not None:
            resp = await client.get(
                "/v1/kv_events", params={"since": entry.next_seq}, timeout=self.timeout_s
            )
            if resp.status_code == 200 and self.index.apply_events(name, resp.json()):
                return True
        resp = await client.get("/v1/kv_events/snapshot", timeout=self.timeout_s)
        if resp.status_code != 200:
            return False
        self.index.apply_snapshot(name, resp.json())
        return name in self.index.entries

    def _start_polls(self) -> None:
        for name, client in self.replicas():
            if name not in self._in_flight:
                task = asyncio.create_task(self._poll(name, client))
                self._in_flight[name] = task
                task.add_done_callback(self._poll_done)

    def _poll_done(self, task: asyncio.Task[None]) -> None:
        for name, running in list(self._in_flight.items()):
            if running is task:
                del self._in_flight[name]

    async def run(self, interval_s: float = POLL_INTERVAL_S) -> None:
        try:
            while True:
                self._start_polls()
                await asyncio.sleep(interval_s)
        finally:
            for task in list(self._in_flight.values()):
                task.cancel()
