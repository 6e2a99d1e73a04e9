"""portico/media_fetch.py against a real local HTTP server: an allowed URL comes back as the
same bytes in a data URL; every refusal is an InvalidRequestError naming the field, and the
refused ones that need no connection make none."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
from collections.abc import Iterator

import pytest

from portico.errors import InvalidRequestError
from portico.media_fetch import MediaFetcher, MediaPolicy
from tests.media_server import MediaServer, png

PARAM = "messages[0].content[0].image_url.url"


@pytest.fixture(scope="module")
def server() -> Iterator[MediaServer]:
    s = MediaServer(png())
    s.start()
    yield s
    s.stop()


def fetch(policy: MediaPolicy, url: str) -> str:
    return asyncio.run(MediaFetcher(policy).data_url(url, PARAM))


def refusal(policy: MediaPolicy, url: str) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        fetch(policy, url)
    assert caught.value.param == PARAM
    return str(caught.value)


LOCAL = MediaPolicy.of(["localhost"], ["127.0.0.0/8", "::1/128"], 64 * 1024, 2.0)


def test_an_allowed_url_is_the_same_bytes_as_a_data_url(server: MediaServer) -> None:
    for path in ("/cat.png", "/to-cat"):
        url = fetch(LOCAL, server.url(path))
        assert url.startswith("data:image/png;base64,")
        assert base64.b64decode(url.partition(",")[2]) == server.image


def test_nothing_is_fetched_without_allowed_domains(server: MediaServer) -> None:
    before = sum(server.hits.values())
    assert "no allowed media domains" in refusal(MediaPolicy(), server.url("/cat.png"))
    assert sum(server.hits.values()) == before


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1:{port}/cat.png", "not an allowed media domain"),
        ("ftp://localhost:{port}/cat.png", "only http and https"),
        ("http://user:pw@localhost:{port}/cat.png", "userinfo"),
        ("http://localhost\\@evil.invalid:{port}/cat.png", "characters"),
        ("http://localhost:99999/cat.png", "port"),
    ],
)
def test_urls_the_policy_refuses_make_no_request(server: MediaServer, url: str, words: str) -> None:
    before = sum(server.hits.values())
    assert words in refusal(LOCAL, url.format(port=server.port))
    assert sum(server.hits.values()) == before


def test_an_allowed_name_resolving_to_a_private_address_is_refused(server: MediaServer) -> None:
    # allowed by name, but 127.0.0.1 and ::1 are loopback and no operator network holds them
    policy = MediaPolicy.of(["localhost"], [], 64 * 1024, 2.0)
    before = sum(server.hits.values())
    assert "private, loopback" in refusal(policy, server.url("/cat.png"))
    assert sum(server.hits.values()) == before


@pytest.mark.parametrize("host", ["10.1.2.3", "169.254.169.254", "[::1]", "[fe80::1]", "0.0.0.0"])
def test_private_literal_addresses_are_refused_even_when_named(host: str) -> None:
    policy = MediaPolicy.of([host.strip("[]")], ["192.168.0.0/16"], 64 * 1024, 2.0)
    assert "private, loopback" in refusal(policy, f"http://{host}/cat.png")


def test_redirects_are_rechecked_and_bounded(server: MediaServer) -> None:
    assert "not an allowed media domain" in refusal(LOCAL, server.url("/away"))
    assert "redirects" in refusal(LOCAL, server.url("/loop"))


def test_too_large_too_slow_not_an_image_and_404(server: MediaServer) -> None:
    assert "larger than 65536 bytes" in refusal(LOCAL, server.url("/big.png"))
    assert "longer than 2 s" in refusal(LOCAL, server.url("/slow.png"))
    assert "not a PNG" in refusal(LOCAL, server.url("/page"))
    assert "HTTP 404" in refusal(LOCAL, server.url("/missing"))


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("93.184.216.34", True),
        ("2606:2800:220:1:248:1893:25c8:1946", True),
        ("10.0.0.1", False),
        ("172.16.5.4", False),
        ("192.168.1.1", False),
        ("100.64.0.1", False),  # shared address space (carrier NAT)
        ("127.0.0.1", False),
        ("169.254.169.254", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped: judged by the IPv4 inside
        ("::ffff:93.184.216.34", True),
        ("2002:7f00:1::", False),  # 6to4 around 127.0.0.1
    ],
)
def test_public_addresses_only(address: str, allowed: bool) -> None:
    assert MediaPolicy().address_allowed(ipaddress.ip_address(address)) is allowed


def test_an_operator_network_opens_its_private_range() -> None:
    policy = MediaPolicy.of(["cdn.internal"], ["10.0.0.0/8"])
    assert policy.address_allowed(ipaddress.ip_address("10.2.3.4"))
    assert not policy.address_allowed(ipaddress.ip_address("192.168.1.1"))
    with pytest.raises(ValueError, match="not an IP network"):
        MediaPolicy.of(["cdn.internal"], ["10.0.0.0/33"])
