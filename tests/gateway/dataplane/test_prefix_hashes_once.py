"""One request's block hashes are computed once per replica: scoring every replica, leasing
the chosen one and noting its prompt as routed there reuse them (RouteTokens keeps them), and
they equal the hashes the engine's own KV cache manager stored for the same prompt."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

import portico.contract
from gateway.fleet.prefix_index import RouteTokens
from tests.gateway.dataplane.test_prefix_index import LONG, PROMPT, two_replicas


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> Counter[bytes]:
    """Counts each (parent hash, block) hashed, by its resulting hash."""
    calls: Counter[bytes] = Counter()
    real = portico.contract.hash_block_tokens

    def counting(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
        digest = real(parent, token_ids, extra)
        calls[digest] += 1
        return digest

    monkeypatch.setattr(portico.contract, "hash_block_tokens", counting)
    return calls


def test_picking_and_leasing_hash_each_block_once_per_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool, (r0, r1), _, index = two_replicas(("r0", LONG, "t"), ("r1", PROMPT, "t"))
    calls = count_hashing(monkeypatch)
    tokens = RouteTokens(LONG, cache_salt="t", tenant="t")
    chosen = pool.pick(None, tokens=tokens)
    assert chosen is r0  # the holder of the whole prompt
    lease = pool.acquire(chosen, tokens)
    assert calls and max(calls.values()) == 1
    # r0 hashed every full block of the prompt (all cached there); r1, which holds another
    # prompt, only its first block (a miss)
    assert len(calls) == len(LONG) // 4 + 1
    assert index.cached_tokens("r0", tokens) == len(LONG) // 4 * 4
    assert max(calls.values()) == 1  # asked again: still from the request's own hashes
    lease.release()


def test_kept_hashes_are_the_engines_and_a_fresh_request_hashes_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, _, engines, index = two_replicas(("r0", PROMPT, "t"))
    kept = RouteTokens(PROMPT, cache_salt="t")
    assert list(index.block_hashes("r0", kept)) == list(index.block_hashes("r0", kept))
    assert set(index.block_hashes("r0", kept)) <= set(engines["r0"].kv.pool.cached)
    calls = count_hashing(monkeypatch)
    assert index.cached_tokens("r0", kept) == 20 and not calls  # kept: nothing hashed
    assert index.cached_tokens("r0", RouteTokens(PROMPT, cache_salt="t")) == 20
    assert sum(calls.values()) == len(PROMPT) // 4  # a new request: its own hashes
