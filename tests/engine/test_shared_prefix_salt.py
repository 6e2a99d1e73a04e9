"""Shared prefixes under a salt: the blocks of a declared prefix are hashed under the shared
salt (every tenant holding it hits them), everything after under the tenant's own salt."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from portico.contract import with_shared_prefix

BS = 16
SHARED = list(range(5000, 5040))  # 40 tokens: 2 full blocks and half of a third
TAIL = list(range(100, 148))  # 3 blocks of each tenant's own text


def make_request(rid: str, tokens: list[int], salt: str | None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def prefill(kv: KVCacheManager, req: Request) -> int:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    kv.free(req)
    return num_hit


def salted(tenant: str, shared: str = "plan-corp") -> str:
    return with_shared_prefix(tenant, shared, len(SHARED))


def test_tenants_of_a_plan_share_only_the_declared_prefix() -> None:
    kv = KVCacheManager(100, BS)
    prompt = [*SHARED, *TAIL, 1]
    assert prefill(kv, make_request("a", prompt, salted("tenant-a"))) == 0
    # B sends the very same prompt: only the full blocks of the shared prefix hit
    assert kv.get_computed_blocks(make_request("b", prompt, salted("tenant-b")))[1] == 32
    # A's own repeat hits everything but the last token's block
    assert kv.get_computed_blocks(make_request("a2", prompt, salted("tenant-a")))[1] == 80


def test_the_shared_blocks_are_not_the_unsalted_or_another_plans() -> None:
    kv = KVCacheManager(100, BS)
    prompt = [*SHARED, *TAIL, 1]
    prefill(kv, make_request("a", prompt, salted("tenant-a")))
    assert kv.get_computed_blocks(make_request("x", prompt, None))[1] == 0
    assert kv.get_computed_blocks(make_request("y", prompt, "tenant-a"))[1] == 0
    other_plan = make_request("z", prompt, salted("tenant-b", "plan-other"))
    assert kv.get_computed_blocks(other_plan)[1] == 0


def test_a_prefix_shorter_than_a_block_shares_nothing() -> None:
    kv = KVCacheManager(100, BS)
    prompt = [*SHARED, *TAIL, 1]
    short = with_shared_prefix("tenant-a", "plan-corp", BS - 1)
    prefill(kv, make_request("a", prompt, short))
    assert kv.get_computed_blocks(make_request("b", prompt, short.replace("-a", "-b")))[1] == 0
    # and it hashes exactly as the tenant's plain salt does
    assert kv.get_computed_blocks(make_request("c", prompt, "tenant-a"))[1] == 80


def test_a_suffix_appended_to_the_salt_makes_the_request_unique() -> None:
    # what the engine does for requests that must read their whole prompt (prompt logprobs)
    kv = KVCacheManager(100, BS)
    prompt = [*SHARED, *TAIL, 1]
    prefill(kv, make_request("a", prompt, salted("tenant-a")))
    unique = make_request("u", prompt, salted("tenant-a") + "\x00prompt-read:u")
    assert kv.get_computed_blocks(unique)[1] == 0
