"""A hostile tenant against a real gateway process: generated headers, bodies and JWT claims.

What a user relies on, whatever arrives: never a 5xx, OpenAI's error shape on every refusal,
and a refusal changes nothing (no usage counted, no concurrency slot held, no bucket charged).
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.dataplane.harness import wait_until
from tests.hardening.conftest import MODEL, HardenedGateway

EXAMPLES = 40  # per property; bounded so the suite stays short
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Tenant:
    """A tenant of its own per test, and how many of its requests were answered 200."""

    def __init__(self, gw: HardenedGateway) -> None:
        self.gw = gw
        self.id, self.key = gw.process.create_tenant("standard")
        self.num_served = 0

    def settle(self, status: int) -> None:
        """Count a 200; then usage must reach exactly the 200s (usage is written in batches,
        so it is polled) and no concurrency slot may be left."""
        self.num_served += status == 200
        assert wait_until(
            lambda: self.gw.usage_totals(self.id)["requests"] == self.num_served, timeout=10
        ), (self.gw.usage_totals(self.id), self.num_served)
        assert self.gw.live_slots(self.id) == 0


@pytest.fixture
def tenant(hardened_gateway: HardenedGateway) -> Tenant:
    return Tenant(hardened_gateway)


def assert_refusal_shape(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error


def raw_request(gw: HardenedGateway, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send bytes as they are (httpx would refuse some of them) and read the status line."""
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(head + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway may close before reading all of a huge head
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data


# ----------------------------------------------------------------------------- headers


def test_a_non_ascii_request_id_from_a_tenant_is_replaced_not_a_500(
    hardened_gateway: HardenedGateway, tenant: Tenant
) -> None:
    key = tenant.key
    body = httpx.Request("POST", "/", json=CHAT).content
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
        b"authorization: Bearer " + key.encode() + b"\r\n"
        b"x-request-id: caf\xc3\xa9-\xff\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
    )
    status, data = raw_request(hardened_gateway, head, body)
    assert status == 200, data[:500]
    minted = [ln for ln in data.split(b"\r\n") if ln.lower().startswith(b"x-request-id:")]
    assert minted and minted[0].split(b":", 1)[1].strip().isascii()


@pytest.mark.parametrize(
    "head",
    [
        b"x-big: " + b"a" * (1024 * 1024) + b"\r\n",  # one 1 MiB line
        b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 4000) for i in range(16)),  # 64 KiB in all
    ],
    ids=["one-line-of-1MiB", "64KiB-of-lines"],
)
def test_oversized_headers_get_431_without_nginx(
    hardened_gateway: HardenedGateway, head: bytes
) -> None:
    status, data = raw_request(
        hardened_gateway, b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n" + head + b"\r\n"
    )
    assert status == 431, data[:300]
    assert b'"error"' in data
    assert httpx.get(hardened_gateway.url + "/health").status_code == 200  # still serving


header_names = st.sampled_from(
    ["x-request-id", "authorization", "content-type", "x-portico-tier", "accept", "x-forwarded-for"]
) | st.from_regex(r"\Ax-[a-z0-9-]{1,20}\Z")
header_values = st.binary(min_size=0, max_size=300).filter(
    lambda v: b"\r" not in v and b"\n" not in v and b"\x00" not in v
)


@PROPERTY
@given(headers=st.lists(st.tuples(header_names, header_values), max_size=6))
def test_generated_headers_never_get_a_5xx_nor_change_a_counter(
    hardened_gateway: HardenedGateway, tenant: Tenant, headers: list[tuple[str, bytes]]
) -> None:
    key = tenant.key
    body = httpx.Request("POST", "/", json=CHAT).content
    lines = b"".join(n.encode() + b": " + v.strip() + b"\r\n" for n, v in headers)
    if not any(n == "authorization" for n, _ in headers):
        lines += b"authorization: Bearer " + key.encode() + b"\r\n"
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
        + lines
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\nconnection: close\r\n\r\n"
    )
    status, data = raw_request(hardened_gateway, head, body)
    assert 200 <= status < 500, data[:500]
    tenant.settle(status)


# ----------------------------------------------------------------------------- bodies

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)  # JSON has no infinity
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stream",
        "stream_options",
        "tools",
        "best_of",
        "temperature",
        "cache_salt",
        "user",
    ]
)


@PROPERTY
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    edits=st.dictionaries(fields, json_values, max_size=4),
)
def test_generated_bodies_never_get_a_5xx_and_a_refusal_counts_nothing(
    hardened_gateway: HardenedGateway, tenant: Tenant, path: str, edits: dict[str, Any]
) -> None:
    key = tenant.key
    body = {**CHAT, "prompt": "hi", **edits}
    r = httpx.post(
        hardened_gateway.url + path,
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert_refusal_shape(r)
    tenant.settle(r.status_code)


# ----------------------------------------------------------------------------- JWT claims

claim_values = json_values | st.integers().map(str) | st.floats(allow_nan=False).map(str)


@pytest.mark.parametrize(
    "claims",
    [
        {"exp": "9999999999"},  # a numeric string
        {"iat": "1"},
        {"exp": True},
        {"nbf": "0"},
        {"iss": ["https://idp.test"]},
        {"aud": 7},
        {"sub": 12},
        {"tenant": ["a"]},
        {"scope": {"a": 1}},
    ],
)
def test_a_signed_jwt_with_a_claim_of_the_wrong_type_is_a_401(
    hardened_gateway: HardenedGateway, tenant: Tenant, claims: dict[str, Any]
) -> None:
    token = hardened_gateway.token(**{"tenant": tenant.id, **claims})
    r = httpx.post(
        hardened_gateway.url + "/v1/chat/completions",
        json=CHAT,
        headers={"authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_token"
    tenant.settle(r.status_code)


@PROPERTY
@given(
    claims=st.dictionaries(
        st.sampled_from(
            ["exp", "iat", "nbf", "iss", "aud", "sub", "tenant", "scope", "roles", "jti"]
        ),
        claim_values,
        min_size=1,
        max_size=3,
    )
)
def test_generated_jwt_claims_never_get_a_5xx_nor_change_a_counter(
    hardened_gateway: HardenedGateway, tenant: Tenant, claims: dict[str, Any]
) -> None:
    token = hardened_gateway.token(**{"tenant": tenant.id, **claims})
    r = httpx.post(
        hardened_gateway.url + "/v1/chat/completions",
        json=CHAT,
        headers={"authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert_refusal_shape(r)
    tenant.settle(r.status_code)
