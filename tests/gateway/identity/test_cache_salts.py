"""The engine's cache salt: a client's ``cache_salt`` is checked at the edge (a 400 naming the
field) and only narrows its tenant's salt; it never reaches the engine raw."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.body.fields import match_shared_prefix, parse_fields
from gateway.identity.cache_salts import narrowed_salt
from gateway.relay.usage_relay import upstream_body
from portico.errors import InvalidRequestError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
KIND_BODIES = {
    "chat": CHAT,
    "completion": {"model": "m", "prompt": "hi"},
    "responses": {"model": "m", "input": "hi"},
    "embedding": {"model": "m", "input": "hi"},
}


def _raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


@pytest.mark.parametrize("kind", sorted(KIND_BODIES))
@pytest.mark.parametrize("salt", [5, ["x"], {"a": 1}, True, "", "x" * 1025])
def test_a_client_cache_salt_that_is_not_a_short_string_is_a_400(kind: str, salt: Any) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        parse_fields(_raw({**KIND_BODIES[kind], "cache_salt": salt}), kind)
    assert exc.value.status_code == 400
    assert exc.value.param == "cache_salt"
    assert exc.value.to_dict()["error"]["type"] == "invalid_request_error"


def test_a_null_cache_salt_is_no_salt() -> None:
    fields = parse_fields(_raw({**CHAT, "cache_salt": None}), "chat")
    assert fields.cache_salt is None
    body = json.loads(upstream_body(_raw(fields.body), fields, "m", "tenant-salt"))
    assert body["cache_salt"] == "tenant-salt"


def test_a_client_salt_narrows_the_tenant_salt_and_never_travels_raw() -> None:
    fields = parse_fields(_raw({**CHAT, "cache_salt": "user-42"}), "chat")
    assert fields.cache_salt == "user-42"
    sent = json.loads(upstream_body(_raw(fields.body), fields, "m", "tenant-a"))["cache_salt"]
    assert sent == narrowed_salt("tenant-a", "user-42")
    assert sent.startswith("tenant-a/") and "user-42" not in sent
    # the same client salt under another tenant is another salt: no way into A's blocks
    assert narrowed_salt("tenant-b", "user-42") != sent
    # a client cannot pick a salt that equals its tenant's bare salt or another tenant's
    assert narrowed_salt("tenant-a", "tenant-b") not in ("tenant-a", "tenant-b")
    # stable: the same client salt hits its own cache again
    assert narrowed_salt("tenant-a", "user-42") == sent
    assert narrowed_salt("tenant-a", "user-43") != sent


def test_without_a_tenant_salt_the_client_salt_is_dropped() -> None:
    # remote providers get no salt at all (they are not our cache)
    fields = parse_fields(_raw({**CHAT, "cache_salt": "user-42"}), "chat")
    assert "cache_salt" not in json.loads(upstream_body(_raw(fields.body), fields, "m", None))


def test_a_huge_client_salt_gives_a_bounded_engine_salt() -> None:
    assert len(narrowed_salt("t" * 32, "x" * 1024)) <= 100


PREFIX = "You are the assistant of Example Corp."


def test_the_longest_declared_prefix_the_request_starts_with_is_matched() -> None:
    prefixes = (PREFIX, PREFIX + " Be brief.", "Something else entirely.")
    chat = parse_fields(
        _raw({"model": "m", "messages": [{"role": "system", "content": PREFIX + " Be brief!"}]}),
        "chat",
    )
    assert match_shared_prefix(chat, prefixes) == len(PREFIX)
    completion = parse_fields(
        _raw({"model": "m", "prompt": PREFIX + " Be brief. Hi"}), "completion"
    )
    assert match_shared_prefix(completion, prefixes) == len(PREFIX) + len(" Be brief.")
    assert match_shared_prefix(completion, ()) == 0
    other = parse_fields(_raw({"model": "m", "prompt": "Hello " + PREFIX}), "completion")
    assert match_shared_prefix(other, prefixes) == 0
    parts = parse_fields(
        _raw(
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": PREFIX}]}],
            }
        ),  # fmt: skip
        "chat",
    )
    assert match_shared_prefix(parts, prefixes) == 0  # only plain text content is matched
