"""The gateway's prefix index (gateway/dataplane/prefix_index.py) and the prefix_aware replica
policy (gateway/dataplane/pool.py), fed by a real engine KV cache manager's events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.server.app import create_app
from engine.server.settings import ServerSettings
from gateway.dataplane.pool import Pool, Replica
from gateway.dataplane.prefix_index import PrefixIndex, PrefixIndexFeeder, RouteTokens

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """A real KV cache manager, answering the two routes' documents as the engine does."""

    def __init__(self, num_blocks: int = 32, epoch_seed: bytes = b"r") -> None:
        self.kv = KVCacheManager(num_blocks, BS, hash_seed=epoch_seed * 32)
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.n = 0

    def serve(self, tokens: list[int], salt: str | None = None) -> None:
        self.n += 1
        req = Request(f"q{self.n}", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
        hits, num_hit = self.kv.get_computed_blocks(req)
        assert self.kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_blocks(req, req.num_tokens)
        self.kv.free(req)

    def snapshot(self) -> dict[str, Any]:
        assert self.kv.events is not None
        snap = self.kv.events.snapshot()
        return {
            "epoch": snap.epoch,
            "next_seq": snap.next_seq,
            "block_size": BS,
            "hash_root": self.kv.root_hash.hex(),
            "hashes": [h.hex() for h in snap.hashes],
        }

    def events(self, since: int) -> dict[str, Any]:
        assert self.kv.events is not None
        batch = self.kv.events.since(since)
        return {
            "epoch": batch.epoch,
            "next_seq": batch.next_seq,
            "resync": batch.resync,
            "events": [
                {
                    "seq": e.seq,
                    "type": e.kind,
                    "hashes": [e.block_hash.hex()] if e.block_hash else [],
                }
                for e in batch.events
            ],
            "num_waiting": self.num_waiting,
            "num_running": 0,
            "kv_cache_usage": self.kv_usage,
        }


PROMPT = list(range(10, 30))  # 5 full blocks
LONG = list(range(1000, 1401))  # 100 full blocks


def test_events_in_order_build_the_longest_cached_prefix() -> None:
    engine, index = Engine(), PrefixIndex()
    index.apply_snapshot("a", engine.snapshot())
    assert index.cached_tokens("a", RouteTokens(PROMPT)) == 0
    engine.serve(PROMPT[:13])  # 3 full blocks cached
    assert index.apply_events("a", engine.events(index.entries["a"].next_seq))
    assert index.cached_tokens("a", RouteTokens(PROMPT)) == 12
    assert index.cached_tokens("a", RouteTokens([99, *PROMPT])) == 0  # another prefix
    # the salt is inside the hash: the same tokens under another tenant's salt match nothing
    assert index.cached_tokens("a", RouteTokens(PROMPT, cache_salt="tenant-b")) == 0
    engine.serve(PROMPT, salt="tenant-b")
    assert index.apply_events("a", engine.events(index.entries["a"].next_seq))
    assert index.cached_tokens("a", RouteTokens(PROMPT, cache_salt="tenant-b")) == 20


def test_a_repeated_or_late_answer_is_skipped_and_a_gap_forces_a_resync() -> None:
    engine, index = Engine(), PrefixIndex()
    index.apply_snapshot("a", engine.snapshot())
    engine.serve(PROMPT[:9])  # events 1, 2
    first = engine.events(1)
    assert index.apply_events("a", first)
    assert index.apply_events("a", first)  # the same answer again: nothing applied twice
    assert index.entries["a"].next_seq == 3
    engine.serve(PROMPT[:17])  # events 3, 4
    late = engine.events(1)  # an answer that overlaps what was applied
    assert index.apply_events("a", late)
    assert index.cached_tokens("a", RouteTokens(PROMPT)) == 16
    engine.serve(PROMPT)  # event 5
    gap = engine.events(5)
    gap["events"][0]["seq"] = 7  # events 5 and 6 never arrived
    assert not index.apply_events("a", gap)
    assert "a" not in index.entries and index.cached_tokens("a", RouteTokens(PROMPT)) is None


def test_evicted_blocks_leave_the_index() -> None:
    engine, index = Engine(num_blocks=5), PrefixIndex()
    index.apply_snapshot("a", engine.snapshot())
    engine.serve(PROMPT)  # all 5 blocks cached
    assert index.apply_events("a", engine.events(1))
    assert index.cached_tokens("a", RouteTokens(PROMPT)) == 20
    engine.serve(list(range(500, 508)))  # 2 blocks reused: the LRU head, PROMPT's tail first
    assert index.apply_events("a", engine.events(index.entries["a"].next_seq))
    assert index.cached_tokens("a", RouteTokens(PROMPT)) == 12


def test_a_restarted_replica_is_resynced_from_its_new_snapshot() -> None:
    old, index = Engine(), PrefixIndex()
    index.apply_snapshot("a", old.snapshot())
    old.serve(PROMPT)
    assert index.apply_events("a", old.events(1))
    new = Engine(epoch_seed=b"n")  # the same replica name, a new process: new epoch, new root
    assert not index.apply_events("a", new.events(index.entries["a"].next_seq))
    assert "a" not in index.entries  # nothing of the old process is scored
    new.serve(PROMPT[:8])
    index.apply_snapshot("a", new.snapshot())
    assert index.cached_tokens("a", RouteTokens(PROMPT)) == 8


def test_a_stale_entry_is_not_scored_and_the_pool_falls_back_to_load() -> None:
    """Stale means the replica's polls have failed for the bound, not that we polled late."""
    clock = Clock()
    index = PrefixIndex(stale_after_s=5.0, clock=clock)
    engine = Engine(num_blocks=128)
    engine.serve(LONG)
    index.apply_snapshot("r0", engine.snapshot())
    replicas = [Replica(f"r{i}", httpx.AsyncClient(), up=True) for i in range(2)]
    pool = Pool("m", replicas, replica_policy="prefix_aware", index=index)
    replicas[0].outstanding = 1  # r0 holds 400 prompt tokens but is busier
    assert pool.pick(None, tokens=RouteTokens(LONG)) is replicas[0]
    clock.now += 60.0  # a gateway starved or paused for a minute, no poll failed: trusted
    assert pool.pick(None, tokens=RouteTokens(LONG)) is replicas[0]
    index.note_poll_failed("r0", clock.now)
    clock.now += 5.0  # failing for the bound, not past it: still trusted
    assert index.cached_tokens("r0", RouteTokens(LONG)) == 400
    index.note_poll_failed("r0", clock.now)  # a later failure does not restart the count
    clock.now += 0.5
    assert index.cached_tokens("r0", RouteTokens(LONG)) is None
    assert pool.pick(None, tokens=RouteTokens(LONG)) is replicas[1]  # least loaded
    assert index.apply_events("r0", engine.events(index.entries["r0"].next_seq))  # answers again
    assert pool.pick(None, tokens=RouteTokens(LONG)) is replicas[0]


def test_the_holder_wins_until_its_queue_outweighs_the_saved_prefill() -> None:
    """Work = queued requests x their cost + this request's uncached tokens: the holder of
    400 of 401 prompt tokens keeps the request behind a queue that costs less than 400."""
    index = PrefixIndex()
    holder, empty = Engine(num_blocks=128), Engine(num_blocks=128, epoch_seed=b"e")
    holder.serve(LONG)
    for name, engine in (("r0", holder), ("r1", empty)):
        index.apply_snapshot(name, engine.snapshot())
        assert index.apply_events(name, engine.events(1))
    replicas = [Replica(f"r{i}", httpx.AsyncClient(), up=True) for i in range(2)]
    pool = Pool("m", replicas, replica_policy="prefix_aware", index=index)
    tokens = RouteTokens(LONG)
    assert {pool.pick(None, tokens=tokens).name for _ in range(4)} == {"r0"}  # type: ignore[union-attr]
    # far past least_loaded's slack of 2: 10 queued (cached) requests cost 10 x 16 < 400
    replicas[0].outstanding = 10
    assert pool.pick(None, tokens=tokens) is replicas[0]
    # other gateways' requests queued there too (the engine's waiting queue): 30 x 16 > 400
    holder.num_waiting = 30
    assert index.apply_events("r0", holder.events(index.entries["r0"].next_seq))
    assert pool.pick(None, tokens=tokens) is replicas[1]
    # that request's blocks count as cached on r1 now (routed, unconfirmed), so r1 holds the
    # prefix too: with one cold request queued there (costed 401) it still weighs less
    replicas[1].outstanding = 1
    assert pool.pick(None, tokens=tokens) is replicas[1]
    # a holder whose KV cache is nearly full gets no prefix credit: the lighter queue wins
    holder.num_waiting, holder.kv_usage = 0, 0.97
    assert index.apply_events("r0", holder.events(index.entries["r0"].next_seq))
    assert pool.pick(None, tokens=tokens) is replicas[1]


def test_equal_work_spreads_evenly() -> None:
    index = PrefixIndex()
    for name, seed in (("r0", b"a"), ("r1", b"b")):
        index.apply_snapshot(name, Engine(epoch_seed=seed).snapshot())
    replicas = [Replica(f"r{i}", httpx.AsyncClient(), up=True) for i in range(2)]
    pool = Pool("m", replicas, replica_policy="prefix_aware", index=index)
    cold = [RouteTokens(list(range(700 + 40 * i, 720 + 40 * i))) for i in range(8)]
    chosen = [pool.pick(None, tokens=t).name for t in cold]  # type: ignore[union-attr]
    assert chosen.count("r0") == chosen.count("r1") == 4


def test_a_routed_prompt_counts_as_cached_until_confirmed_or_expired() -> None:
    """A tenant's second request, sent while the first is still prefilling, follows it."""
    clock = Clock()
    index = PrefixIndex(clock=clock)
    engines = {"r0": Engine(), "r1": Engine(epoch_seed=b"e")}
    for name, engine in engines.items():
        index.apply_snapshot(name, engine.snapshot())
    replicas = [Replica(name, httpx.AsyncClient(), up=True) for name in engines]
    pool = Pool("m", replicas, replica_policy="prefix_aware", index=index)
    tokens = RouteTokens(PROMPT, cache_salt="t")
    first = pool.pick(None, tokens=tokens)
    assert first is not None
    assert index.cached_tokens(first.name, tokens) == 20  # not stored yet: routed
    assert all(pool.pick(None, tokens=tokens) is first for _ in range(3))
    other = next(r for r in replicas if r is not first)
    assert index.cached_tokens(other.name, tokens) == 0
    # the engine confirms the blocks: they stay after the routed mark expires
    engines[first.name].serve(PROMPT, salt="t")
    assert index.apply_events(first.name, engines[first.name].events(1))
    assert index.entries[first.name].routed == {}
    clock.now += 60.0
    for name, engine in engines.items():  # fresh again
        assert index.apply_events(name, engine.events(index.entries[name].next_seq))
    assert index.cached_tokens(first.name, tokens) == 20
    # a routed prompt the engine never stored stops counting after its TTL
    lost = RouteTokens(list(range(300, 320)))
    chosen = pool.pick(None, tokens=lost)
    assert chosen is not None and index.cached_tokens(chosen.name, lost) == 20
    clock.now += 11.0
    for name, engine in engines.items():
        assert index.apply_events(name, engine.events(index.entries[name].next_seq))
    assert index.cached_tokens(chosen.name, lost) == 0


def test_round_robin_ignores_load_and_least_loaded_ignores_the_index() -> None:
    replicas = [Replica(f"r{i}", httpx.AsyncClient(), up=True) for i in range(3)]
    replicas[0].outstanding = 50
    rr = Pool("m", replicas, replica_policy="round_robin")
    assert {rr.pick(None).name for _ in range(3)} == {"r0", "r1", "r2"}  # type: ignore[union-attr]
    index = PrefixIndex()
    engine = Engine()
    engine.serve(PROMPT)
    index.apply_snapshot("r0", engine.snapshot())
    least = Pool("m", replicas, replica_policy="least_loaded", index=index)
    assert least.pick(None, tokens=RouteTokens(PROMPT)) is not replicas[0]


def test_the_index_is_bounded_per_replica() -> None:
    engine, index = Engine(), PrefixIndex(max_hashes=3)
    engine.serve(PROMPT)  # 5 hashes
    index.apply_snapshot("a", engine.snapshot())
    assert "a" not in index.entries  # over the bound: not indexed (load-only for it)


async def test_feeder_indexes_two_real_tiny_engines_and_routes_a_repeat_to_its_holder(
    tiny_llama_dir: Path,
) -> None:
    """Two in-process tiny engines: a prompt served by one is routed back to it."""
    engines = [
        AsyncLLMEngine.from_config(
            EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB", max_model_len=128)
        )
        for _ in range(2)
    ]
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(e, ServerSettings(served_model_name="t"))),
            base_url="http://engine",
        )
        for e in engines
    ]
    replicas = [Replica(f"r{i}", c, up=True) for i, c in enumerate(clients)]
    index = PrefixIndex()
    pool = Pool("t", replicas, replica_policy="prefix_aware", index=index)
    feeder = PrefixIndexFeeder(index, pool.available_clients)
    for e in engines:
        await e.start()
    try:
        await feeder.poll_once()
        assert set(index.entries) == {"r0", "r1"}
        prompt = list(range(5, 70))
        for target in (1, 0):
            served = [t + target * 100 for t in prompt]
            resp = await clients[target].post(
                "/v1/completions",
                json={"model": "t", "prompt": served, "max_tokens": 1, "cache_salt": "s"},
            )
            assert resp.status_code == 200
        await feeder.poll_once()
        for target in (0, 1):
            tokens = RouteTokens([t + target * 100 for t in prompt], cache_salt="s")
            for _ in range(3):
                assert pool.pick(None, tokens=tokens) is replicas[target]
            assert (index.cached_tokens(f"r{target}", tokens) or 0) >= 48
            # the other tenant's salt: no replica holds it, so no prefix pulls it anywhere
            assert index.cached_tokens(f"r{target}", RouteTokens(tokens.token_ids, "x")) == 0
    finally:
        for e in engines:
            await e.shutdown()
        for c in clients:
            await c.aclose()


@pytest.mark.parametrize("answer", [404, "garbage"])
async def test_feeder_leaves_a_replica_without_events_unindexed(answer: int | str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if answer == 404:
            return httpx.Response(404, json={"error": {"message": "nope"}})
        return httpx.Response(200, content=b"not json")

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x")
    index = PrefixIndex()
    await PrefixIndexFeeder(index, lambda: [("a", client)]).poll_once()
    assert index.entries == {}


async def test_the_gateway_computes_the_tokens_and_salt_the_engine_hashes(
    tiny_llama_dir: Path,
) -> None:
    """From the client's body to the engine's block hashes: the tokens the gateway derives
    equal the engine's own /tokenize, the salt is the one upstream_body sends, and the blocks
    the engine stores for that exact payload are the ones the index matches."""
    import json

    from gateway.admission.prompt_tokens import load_tokenizer
    from gateway.dataplane.fields import parse_fields
    from gateway.dataplane.prefix_index import route_token_ids
    from gateway.dataplane.proxy import LocalUpstream
    from gateway.dataplane.retry import RetryPolicy
    from gateway.dataplane.usage_relay import upstream_body
    from gateway.identity.principal import Limits, Principal
    from gateway.metrics import GatewayMetrics

    engine = AsyncLLMEngine.from_config(
        EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB", max_model_len=256)
    )
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(
            app=create_app(engine, ServerSettings(served_model_name="t"))
        ),
        base_url="http://engine",
    )
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    assert tokenizer is not None
    index = PrefixIndex()
    pool = Pool("t", [Replica("r0", client, up=True)], replica_policy="prefix_aware", index=index)
    upstream = LocalUpstream(pool, RetryPolicy(), GatewayMetrics())
    principal = Principal(tenant_id="acme", plan="p", limits=Limits(), cache_salt="tenant-acme")
    text = "the quick brown fox jumps over the lazy dog " * 8
    raw = json.dumps({"model": "t", "prompt": text, "max_tokens": 1, "cache_salt": "u1"}).encode()
    fields = parse_fields(raw, "completion")
    await engine.start()
    try:
        engine_ids = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
        assert route_token_ids(tokenizer, fields) == engine_ids
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            chat = parse_fields(json.dumps({"model": "t", "messages": messages}).encode(), "chat")
            engine_chat = await client.post(
                "/tokenize", json={"messages": messages, "add_generation_prompt": True}
            )
            assert route_token_ids(tokenizer, chat) == engine_chat.json()["tokens"]
        assert upstream._route_tokens(fields, principal) is None  # no tokenizer: load only
        upstream.route_tokenizer = tokenizer
        tokens = upstream._route_tokens(fields, principal)
        assert tokens is not None
        payload = upstream.payload(raw, fields, "t", principal.cache_salt, None)
        assert tokens.cache_salt == json.loads(payload)["cache_salt"]
        assert payload == upstream_body(raw, fields, "t", principal.cache_salt, None, True)
        feeder = PrefixIndexFeeder(index, pool.available_clients)
        await feeder.poll_once()
        assert index.cached_tokens("r0", tokens) == 0
        resp = await client.post(
            "/v1/completions", content=payload, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 200, resp.text
        await feeder.poll_once()
        block_size = index.entries["r0"].block_size
        cached = index.cached_tokens("r0", tokens)
        assert cached == len(engine_ids) // block_size * block_size > 0
        pool.replica_policy = "least_loaded"  # another policy: no tokens are derived
        assert upstream._route_tokens(fields, principal) is None
    finally:
        await engine.shutdown()
        await client.aclose()


async def test_feeder_retries_a_closed_connection_and_marks_only_failing_replicas() -> None:
    """An engine closes a pooled connection its keep-alive let expire (seen after the gateway
    was paused past the staleness bound): the poll is retried at once and the entry stays
    exact; a replica that keeps failing goes stale after the bound, counted from its first
    failure."""
    clock = Clock()
    index = PrefixIndex(stale_after_s=5.0, clock=clock)
    engine = Engine()
    engine.serve(PROMPT)
    calls = {"ok": 0, "down": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls[host] += 1
        if host == "down" and calls[host] > 1 or host == "ok" and calls[host] == 2:
            raise httpx.RemoteProtocolError("the server closed the connection")
        if request.url.path.endswith("/snapshot"):
            return httpx.Response(200, json=engine.snapshot())
        return httpx.Response(200, json=engine.events(int(request.url.params["since"])))

    clients = {
        name: httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url=f"http://{name}")
        for name in calls
    }
    feeder = PrefixIndexFeeder(index, lambda: list(clients.items()))
    await feeder.poll_once()  # both snapshots
    await feeder.poll_once()  # ok: closed, retried, answered; down: failed twice
    assert feeder.failed_polls == 1 and calls["ok"] == 3
    assert index.entries["ok"].failing_since is None
    assert index.entries["down"].failing_since == clock.now
    clock.now += 5.5
    await feeder.poll_once()
    assert index.cached_tokens("ok", RouteTokens(PROMPT)) == 20
    assert index.cached_tokens("down", RouteTokens(PROMPT)) is None
