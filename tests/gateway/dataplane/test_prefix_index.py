"""The gateway's prefix index (gateway/fleet/prefix_index.py) and the prefix_aware replica
policy (gateway/fleet/pool.py), fed by a real engine KV cache manager's events."""

from __future__ import annotations

from typing import Any

import httpx

from engine.kv_cache_manager import KVCacheManager
from engine.lora.adapter import LoRARequest
from engine.request import Request
from engine.sampling_params import SamplingParams
from gateway.fleet.pool import Pool, Replica
from gateway.fleet.prefix_index import PrefixIndex, RouteTokens

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
        self.num_running = 0
        self.kv_usage = 0.0
        self.lora_adapters: dict[str, int] = {}  # name -> this engine's number for it
        self.lora_resident: list[str] = []
        self.n = 0

    def serve(self, tokens: list[int], salt: str | None = None, adapter: str | None = None) -> None:
        self.n += 1
        lora = None
        if adapter is not None:
            lora = LoRARequest(adapter, self.lora_adapters[adapter], "/adapters/" + adapter)
        req = Request(
            f"q{self.n}", tokens, SamplingParams(max_tokens=1), cache_salt=salt, lora_request=lora
        )
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
            "num_running": self.num_running,
            "kv_cache_usage": self.kv_usage,
            "lora_adapters": self.lora_adapters,
            "lora_resident": self.lora_resident,
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


def two_replicas(
    *holding: tuple[str, list[int], str | None],
) -> tuple[Pool, list[Replica], dict[str, Engine], PrefixIndex]:
    """A prefix_aware pool over r0 and r1, real KV cache managers behind them, each ``(name,
    tokens, salt)`` served (so cached) on that replica and the index synced."""
    index = PrefixIndex()
    engines = {"r0": Engine(num_blocks=256), "r1": Engine(num_blocks=256, epoch_seed=b"e")}
    for name, tokens, salt in holding:
        engines[name].serve(tokens, salt=salt)
    sync(index, engines)
    replicas = [Replica(name, httpx.AsyncClient(), up=True) for name in engines]
    return Pool("m", replicas, replica_policy="prefix_aware", index=index), replicas, engines, index


def sync(index: PrefixIndex, engines: dict[str, Engine]) -> None:
    for name, engine in engines.items():
        if name not in index.entries:
            index.apply_snapshot(name, engine.snapshot())
        assert index.apply_events(name, engine.events(index.entries[name].next_seq))


def test_the_holder_keeps_a_tenant_while_other_tenants_prefill_there() -> None:
    """Other tenants' cold prompts on the holder sit out this tenant's short step (its one
    uncached token; FairPolicy.short_step) and their decode rows share it: less than its 400
    cached tokens recomputed elsewhere."""
    pool, (r0, r1), _, _ = two_replicas(("r0", LONG, "t"))
    tokens = RouteTokens(LONG, cache_salt="t", tenant="t")
    r0.load.lease(401, "u")
    r0.load.lease(401, "v")
    for _ in range(3):
        r0.load.lease(0, "w").first_token()
    assert r0.outstanding == 5 and r1.outstanding == 0  # least_loaded's slack of 2 is long past
    assert pool.pick(None, tokens=tokens) is r0
    # a queue of others (another gateway's, as the engine reports it) past the prompt: spill
    r0.load = type(r0.load)()
    pool.index.entries["r0"].num_waiting = 60  # type: ignore[union-attr]  # 60 x 16 tokens
    assert pool.pick(None, tokens=tokens) is r1


def test_a_tenant_spills_when_its_own_requests_pile_up_on_the_holder() -> None:
    """Its own pending prefill is ahead of it there (FCFS within a tenant, each other tenant's
    sharing the steps until its need is met): past the cost of recomputing the prompt
    elsewhere, it spills to the second replica, which then caches it too and shares the
    tenant."""
    pool, (r0, r1), _, index = two_replicas(("r0", LONG, "t"))
    tokens = RouteTokens(LONG, cache_salt="t", tenant="t")
    own = pool.acquire(r0, RouteTokens(list(range(5000, 5401)), cache_salt="t", tenant="t"))
    assert own.prefill_tokens == 401  # a cold prompt of the tenant's, still prefilling on r0
    assert pool.pick(None, tokens=tokens) is r0  # waiting for one's own 401 beats recomputing
    r0.load.lease(401, "u")  # and another tenant's cold prompt beside it: 803 there
    first = pool.pick(None, tokens=tokens)
    assert first is r1
    spilled = pool.acquire(r1, tokens)
    assert spilled.prefill_tokens == 401 and r1.load.tenant_prefill == {"t": 401}
    assert index.cached_tokens("r1", tokens) == 400  # routed there: it holds the prefix now
    # the next one waits for that prefill on r1 (less than the pile on r0)
    assert pool.pick(None, tokens=tokens) is r1
    spilled.first_token()
    own.release()
    # both hold it; r0's pile is another tenant's now, which sits out the short step of this
    # one's last token (FairPolicy.short_step), against a decode row in every step on r1
    assert pool.pick(None, tokens=tokens) is r0
    r0.load.lease(300, "t")  # the tenant's own prompt pending on r0: the other's shares it
    assert pool.pick(None, tokens=tokens) is r1


def burst_prompt(tenant: str, question: int) -> RouteTokens:
    """A tenant's system prompt (812 tokens, its own per tenant) and a 20-token question."""
    base = 10_000 * (1 + ord(tenant[0]))
    system = list(range(base, base + 812))
    return RouteTokens([*system, *range(question, question + 20)], cache_salt=tenant, tenant=tenant)


def test_in_the_opening_burst_a_tenants_next_question_stays_on_its_holder() -> None:
    """Tenant A's first question is prefilling on r0 beside B's and C's cold prompts; its
    second (20 tokens past the system prompt, counted cached on r0 since the first was routed
    there) weighs r0's 2,616 against r1's D and E, each sharing the steps with an 832-token
    cold prompt there: 2,596 + 812 recomputed. The rule before charged r1 one chunk of D's and
    E's (1,138 + 812) and spilled it, to compute the system prompt a second time."""
    pool, (r0, r1), _, _ = two_replicas()
    for tenant in "ABC":
        pool.acquire(r0, burst_prompt(tenant, 1))
    for tenant in "DE":
        pool.acquire(r1, burst_prompt(tenant, 1))
    second = burst_prompt("A", 2)
    assert pool.index is not None and pool.index.cached_tokens("r0", second) == 812
    assert {pool.pick(None, tokens=second).name for _ in range(4)} == {"r0"}  # type: ignore[union-attr]


def test_a_new_tenants_cold_prompt_goes_where_fewer_tenants_prefill() -> None:
    """Two tenants' cold prompts pending on r0, one on r1: a new tenant shares each step with
    every one of them, so r1 (the rule before saw one chunk of prefill on each, a tie, and
    sent every other new tenant to r0, where its later questions then queued behind three)."""
    pool, (r0, r1), _, _ = two_replicas()
    for tenant in "AB":
        pool.acquire(r0, burst_prompt(tenant, 1))
    pool.acquire(r1, burst_prompt("D", 1))
    assert {pool.pick(None, tokens=burst_prompt("C", 1)).name for _ in range(4)} == {"r1"}  # type: ignore[union-attr]


def test_a_request_sharing_blocks_another_is_computing_follows_it() -> None:
    """A tenant's second question sent while its first still prefills the system prompt on
    that replica follows the first (the engine would compute the blocks again side by side);
    once the engine stores them, nobody follows."""
    pool, (r0, _), engines, index = two_replicas()
    system = list(range(2000, 2400))  # 100 blocks
    first = RouteTokens([*system, 1, 2, 3, 4], cache_salt="t", tenant="t")
    second = RouteTokens([*system, 5, 6, 7, 8], cache_salt="t", tenant="t")
    lead = pool.acquire(r0, first)
    assert lead.follows is None and len(lead.blocks) == 101
    follow = pool.acquire(r0, second)
    assert follow.follows is lead and len(follow.blocks) == 1  # its own question's block
    other_salt = pool.acquire(r0, RouteTokens(second.token_ids, cache_salt="u", tenant="u"))
    assert other_salt.follows is None  # another tenant's salt: other blocks
    lead.first_token()
    engines["r0"].serve(first.token_ids, salt="t")
    sync(index, engines)
    third = pool.acquire(r0, RouteTokens([*system, 9, 9, 9, 9], cache_salt="t", tenant="t"))
    assert third.follows is None and len(third.blocks) == 1
    for lease in (follow, other_salt, third):
        lease.release()
    assert r0.load.computing == {} and r0.outstanding == 1  # the first, decoding


def test_the_running_batch_and_the_engines_queue_weigh_between_two_holders() -> None:
    pool, (r0, r1), engines, index = two_replicas(("r0", LONG, None), ("r1", LONG, None))
    tokens = RouteTokens(LONG, tenant="t")
    for _ in range(6):
        r0.load.lease(0, "x").first_token()
    for _ in range(2):
        r1.load.lease(0, "x").first_token()
    assert pool.pick(None, tokens=tokens) is r1  # fewer decode rows in every step
    engines["r1"].num_running = 20  # the engine runs more than ours (another gateway's)
    sync(index, engines)
    assert pool.pick(None, tokens=tokens) is r0
    engines["r0"].num_waiting = 30  # and queues prompts beyond ours: ahead of this one
    sync(index, engines)
    assert pool.pick(None, tokens=tokens) is r1


def test_the_tenants_fair_share_decides_between_two_holders() -> None:
    """Equal pending prefill on both: where it is another tenant's, this tenant's one uncached
    token runs in a short step past all of it; where it is its own, it waits for all of it.
    (Queue x average cost, an earlier scorer, saw the two as equal.)"""
    pool, (r0, r1), _, _ = two_replicas(("r0", LONG, "t"), ("r1", LONG, "t"))
    tokens = RouteTokens(LONG, cache_salt="t", tenant="t")
    r0.load.lease(600, "t")
    r1.load.lease(600, "u")
    assert {pool.pick(None, tokens=tokens).name for _ in range(4)} == {"r1"}  # type: ignore[union-attr]
    other = RouteTokens(LONG, cache_salt="t", tenant="u")  # the other way round for tenant u
    assert {pool.pick(None, tokens=other).name for _ in range(4)} == {"r0"}  # type: ignore[union-attr]


def test_an_adapters_prefix_is_hashed_per_replica_and_a_resident_adapter_is_preferred() -> None:
    """Each engine numbers its adapters itself and the number is inside the block hash: the
    index matches an adapter's prompt with each replica's own number; between two holders
    the one with the adapter in a slot wins."""
    index = PrefixIndex()
    engines = {"r0": Engine(num_blocks=256), "r1": Engine(num_blocks=256, epoch_seed=b"e")}
    engines["r0"].lora_adapters = {"acme-sql": 1}
    engines["r1"].lora_adapters = {"other": 1, "acme-sql": 2}
    for engine in engines.values():
        engine.serve(LONG, salt="t", adapter="acme-sql")
    sync(index, engines)
    replicas = [Replica(name, httpx.AsyncClient(), up=True) for name in engines]
    pool = Pool("m", replicas, replica_policy="prefix_aware", index=index)
    tokens = RouteTokens(LONG, cache_salt="t", tenant="t", model="acme-sql")
    assert index.cached_tokens("r0", tokens) == index.cached_tokens("r1", tokens) == 400
    base = RouteTokens(LONG, cache_salt="t", tenant="t", model="m")  # the base model's blocks
    assert index.cached_tokens("r0", base) == index.cached_tokens("r1", base) == 0
    engines["r1"].lora_resident = ["acme-sql"]
    sync(index, engines)
    assert {pool.pick(None, tokens=tokens).name for _ in range(4)} == {"r1"}  # type: ignore[union-attr]
    engines["r0"].lora_resident = ["acme-sql"]
    engines["r1"].lora_resident = ["other"]
    sync(index, engines)
    assert {pool.pick(None, tokens=tokens).name for _ in range(4)} == {"r0"}  # type: ignore[union-attr]


def test_a_nearly_full_cache_gets_no_prefix_credit() -> None:
    pool, (r0, r1), engines, index = two_replicas(("r0", LONG, None))
    tokens = RouteTokens(LONG)
    assert pool.pick(None, tokens=tokens) is r0
    engines["r0"].kv_usage = 0.97  # about to evict, and a new request may preempt one there
    sync(index, engines)
    r0.load.lease(0, "x").first_token()  # then the lighter replica wins
    assert pool.pick(None, tokens=tokens) is r1


def test_equal_work_spreads_evenly() -> None:
    index = PrefixIndex()
    for name, seed in (("r0", b"a"), ("r1", b"b")):
        index.apply_snapshot(name, Engine(epoch_seed=seed).snapshot())
    replicas = [Replica(f"r{i}", httpx.AsyncClient(), up=True) for i in range(2)]
    pool = Pool("m", replicas, replica_policy="prefix_aware", index=index)
    cold = [RouteTokens(list(range(700 + 40 * i, 720 + 40 * i)), tenant=f"t{i}") for i in range(8)]
    chosen = []
    for tokens in cold:  # eight tenants' first prompts, all still prefilling
        replica = pool.pick(None, tokens=tokens)
        assert replica is not None
        pool.acquire(replica, tokens)
        chosen.append(replica.name)
    assert chosen.count("r0") == chosen.count("r1") == 4
    assert replicas[0].load.pending_prefill == replicas[1].load.pending_prefill == 80


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
    assert index.cached_tokens(first.name, tokens) == 0  # a pick alone commits nothing
    pool.acquire(first, tokens)
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
    assert chosen is not None
    pool.acquire(chosen, lost)
    assert index.cached_tokens(chosen.name, lost) == 20
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
