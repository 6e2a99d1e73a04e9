"""The prefix index fed over HTTP (gateway/fleet/prefix_index.py, PrefixIndexFeeder): real tiny
engines polled for their block events, the tokens and salt the gateway hashes against the
engine's, a feeder's retries, and requests through the proxy that wait for a prefix being
computed. The index and the prefix_aware policy on their own: test_prefix_index.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.server.app import create_app
from engine.server.settings import ServerSettings
from gateway.fleet.pool import Pool, Replica
from gateway.fleet.prefix_index import PrefixIndex, PrefixIndexFeeder, RouteTokens
from tests.gateway.dataplane.test_prefix_index import (
    PROMPT,
    Clock,
    Engine,
)


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


def tiny_engine_client(tiny_llama_dir: Path) -> tuple[Any, httpx.AsyncClient]:
    """A tiny in-process engine (not started) and an httpx client on its app, served as "t"."""
    engine = AsyncLLMEngine.from_config(
        EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB", max_model_len=256)
    )
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(
            app=create_app(engine, ServerSettings(served_model_name="t"))
        ),
        base_url="http://engine",
    )
    return engine, client


async def test_the_gateway_computes_the_tokens_and_salt_the_engine_hashes(
    tiny_llama_dir: Path,
) -> None:
    """From the client's body to the engine's block hashes: the tokens the gateway derives
    equal the engine's own /tokenize, the salt is the one upstream_body sends, and the blocks
    the engine stores for that exact payload are the ones the index matches."""
    import json

    from gateway.admission.prompt_tokens import load_tokenizer
    from gateway.body.fields import parse_fields
    from gateway.fleet.prefix_index import route_token_ids
    from gateway.identity.principal import Limits, Principal
    from gateway.metrics import GatewayMetrics
    from gateway.relay.proxy import LocalUpstream
    from gateway.relay.retry import RetryPolicy
    from gateway.relay.usage_relay import upstream_body

    engine, client = tiny_engine_client(tiny_llama_dir)
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


def proxied_tiny_engine(tiny_llama_dir: Path) -> tuple[Any, ...]:
    """A tiny in-process engine behind a one-replica prefix_aware pool and a LocalUpstream,
    with a principal of tenant "acme": (engine, client, index, replica, pool, upstream,
    principal). The caller starts the engine and closes the engine and the client."""
    from gateway.admission.prompt_tokens import load_tokenizer
    from gateway.identity.principal import Limits, Principal
    from gateway.metrics import GatewayMetrics
    from gateway.relay.proxy import LocalUpstream
    from gateway.relay.retry import RetryPolicy

    engine, client = tiny_engine_client(tiny_llama_dir)
    index = PrefixIndex()
    replica = Replica("r0", client, up=True)
    pool = Pool("t", [replica], replica_policy="prefix_aware", index=index)
    upstream = LocalUpstream(pool, RetryPolicy(max_attempts=1), GatewayMetrics())
    upstream.route_tokenizer = load_tokenizer(str(tiny_llama_dir))
    principal = Principal(tenant_id="acme", plan="p", limits=Limits(), cache_salt="tenant-acme")
    return engine, client, index, replica, pool, upstream, principal


async def test_a_request_through_the_proxy_holds_its_prefill_until_its_first_token(
    tiny_llama_dir: Path,
) -> None:
    """LocalUpstream with a real engine: a stream is charged its uncached prompt (per tenant)
    from the send until its first token, then counts as one decode row until closed; a
    non-streamed answer and a refused one leave nothing behind either."""
    import asyncio
    import json

    from gateway.body.fields import parse_fields
    from gateway.fleet.replica_load import ReplicaLoad

    engine, client, index, replica, pool, upstream, principal = proxied_tiny_engine(tiny_llama_dir)
    text = "the quick brown fox jumps over the lazy dog " * 8

    def request(**extra: Any) -> tuple[bytes, Any]:
        raw = json.dumps({"model": "t", "prompt": text, "max_tokens": 4, **extra}).encode()
        fields = parse_fields(raw, "completion")
        return upstream.payload(raw, fields, "t", principal.cache_salt, None), fields

    await engine.start()
    try:
        await PrefixIndexFeeder(index, pool.available_clients).poll_once()
        payload, fields = request(stream=True)
        tokens = upstream._route_tokens(fields, principal)
        assert tokens is not None and tokens.tenant == "acme" and tokens.model == "t"
        sent = asyncio.create_task(
            upstream.exchange(
                "/v1/completions", payload, fields, "rid-1", None, principal=principal
            )
        )
        for _ in range(1000):  # until it is sent: charged before the engine computed anything
            await asyncio.sleep(0)
            if replica.outstanding:
                break
        assert replica.outstanding == 1
        n = len(tokens.token_ids)  # nothing cached yet: the whole prompt
        assert replica.load.pending_prefill == n and replica.load.tenant_prefill == {"acme": n}
        exchange = await sent
        assert exchange.status == 200 and exchange.rest is not None and exchange.close
        # the in-process transport hands the whole stream over at once: its first events
        # hold the first token, so the request is a decode row now
        assert (replica.load.pending_prefill, replica.load.num_decoding) == (0, 1)
        async for _ in exchange.rest:
            pass
        await exchange.close()
        await exchange.close()  # closing twice gives back nothing twice
        assert replica.load == ReplicaLoad()
        payload, fields = request()  # not streamed: charged until the answer is read
        exchange = await upstream.exchange(
            "/v1/completions", payload, fields, "rid-2", None, principal=principal
        )
        assert exchange.status == 200 and replica.load == ReplicaLoad()
        payload, fields = request(max_tokens=100_000)  # refused by the engine: a 400
        exchange = await upstream.exchange(
            "/v1/completions", payload, fields, "rid-3", None, principal=principal
        )
        assert exchange.status == 400 and replica.load == ReplicaLoad()
    finally:
        await engine.shutdown()
        await client.aclose()


async def test_a_request_sent_while_its_prefix_is_computed_waits_and_hits_the_cache(
    tiny_llama_dir: Path,
) -> None:
    """Two streamed requests sharing a long prefix, the second sent while the first is still
    being computed: the second follows the first (the proxy holds it until the first's first
    token) and finds the prefix cached; nothing is left marked as computing. (This tiny engine
    is quick enough to serve the two one step apart either way; the hold itself is proven in
    tests/gateway/dataplane/test_replica_load.py.)"""
    import asyncio
    import json

    from gateway.body.fields import parse_fields
    from gateway.fleet.replica_load import Lease

    engine, client, index, replica, pool, upstream, principal = proxied_tiny_engine(tiny_llama_dir)
    shared = "the quick brown fox jumps over the lazy dog " * 10

    async def cached_tokens(question: str) -> int:
        raw = json.dumps(
            {"model": "t", "prompt": shared + question, "max_tokens": 2, "stream": True}
        ).encode()
        fields = parse_fields(raw, "completion")
        payload = upstream.payload(raw, fields, "t", principal.cache_salt, None)
        exchange = await upstream.exchange(
            "/v1/completions", payload, fields, question, None, principal=principal
        )
        assert exchange.status == 200 and exchange.rest is not None and exchange.close
        async for _ in exchange.rest:
            pass
        await exchange.close()
        return exchange.usage.cached_tokens

    leases: list[Lease] = []
    acquire = pool.acquire

    def recording_acquire(replica: Replica, tokens: RouteTokens | None = None) -> Lease:
        leases.append(acquire(replica, tokens))
        return leases[-1]

    pool.acquire = recording_acquire  # type: ignore[method-assign]
    await engine.start()
    try:
        await PrefixIndexFeeder(index, pool.available_clients).poll_once()
        first = asyncio.create_task(cached_tokens("one?"))
        for _ in range(1000):  # until the first is sent
            await asyncio.sleep(0)
            if replica.outstanding:
                break
        second = asyncio.create_task(cached_tokens("two?"))
        for _ in range(1000):
            await asyncio.sleep(0)
            if replica.outstanding == 2:
                break
        assert replica.outstanding == 2
        lead, follower = leases
        assert lead.follows is None and follower.follows is lead and lead.streamed
        assert await first == 0
        assert await second >= 64  # the shared prefix's whole blocks
        assert lead.prefilled and replica.load.computing == {}
    finally:
        await engine.shutdown()
        await client.aclose()
