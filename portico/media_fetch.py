"""Fetching ``http(s)`` image URLs safely, for the gateway and the engine server alike.

Off unless an operator names the hosts (vLLM's ``--allowed-media-domains``). A fetch is
refused, as a 400 naming the request's field, when the URL:

- is not ``http``/``https``, carries a userinfo part (``user@``), or names a host that is not
  one of the allowed host names (exact, case-insensitive; no wildcards);
- resolves only to addresses that are not public: private, loopback, link-local, multicast,
  reserved, unspecified, shared (100.64/10), IPv4 and IPv6 alike (an IPv4-mapped or 6to4
  address is judged by the IPv4 address inside), unless an operator network
  (``--allowed-media-networks``) holds it. The check is made on the address the socket is
  then connected to (:class:`_CheckedBackend`), so a name that resolves differently a moment
  later (DNS rebinding) cannot slip a private address past it;
- redirects more than :data:`MAX_REDIRECTS` times, or to a URL that fails any of the above;
- answers other than 200, sends more than ``max_bytes`` (counted while reading, the
  connection dropped at the cap), takes longer than ``timeout_s`` in all (DNS, connect,
  redirects and body together), or sends bytes that are not a PNG, JPEG, WebP or GIF file.

No proxy from the environment is used, and no cookie or credential is ever sent. The answer
is the image as a ``data:`` URL, which the engine decodes as if the client had sent it.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpcore

from portico.errors import InvalidRequestError

MAX_REDIRECTS = 3
DEFAULT_MAX_MEDIA_BYTES = 5 * 2**20
DEFAULT_FETCH_TIMEOUT_S = 5.0
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# File signatures of the formats the engine decodes (engine/multimodal.py IMAGE_FORMATS).
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def image_type(raw: bytes) -> str | None:
    """The MIME type of a PNG, JPEG, WebP or GIF file by its first bytes; None otherwise."""
    for signature, mime in _SIGNATURES:
        if raw.startswith(signature):
            return mime
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return None


def parse_networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    """CIDR strings (``10.0.0.0/8``, ``fd00::/8``) as networks; ValueError naming a bad one."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not an IP network (CIDR): {value!r}") from None
    return tuple(networks)


@dataclass(frozen=True)
class MediaPolicy:
    """What may be fetched: host names, operator networks, a byte cap and a time limit.

    ``allowed_domains`` empty: nothing is fetched (the default)."""

    allowed_domains: frozenset[str] = frozenset()
    allowed_networks: tuple[IPNetwork, ...] = ()
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    @classmethod
    def of(
        cls,
        domains: Iterable[str] = (),
        networks: Iterable[str] = (),
        max_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
        timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
    ) -> MediaPolicy:
        """A policy from flag or config values (host names lower-cased, CIDRs parsed)."""
        names = frozenset(d.strip().lower().rstrip(".") for d in domains if d.strip())
        return cls(names, parse_networks(networks), max_bytes, timeout_s)

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)

    def host_allowed(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.allowed_domains

    def address_allowed(self, address: IPAddress) -> bool:
        """Whether a connection to ``address`` may be made: an operator network holds it,
        or it is a public unicast address."""
        if any(address in net for net in self.allowed_networks):
            return True
        if isinstance(address, ipaddress.IPv6Address):
            inner = address.ipv4_mapped or address.sixtofour
            if inner is not None:
                return self.address_allowed(inner)
            if address.teredo is not None:
                return self.address_allowed(address.teredo[1])
        blocked = (
            address.is_private
            or address.is_loopback
            or address.is_link_local
            or address.is_multicast
            or address.is_reserved
            or address.is_unspecified
        )
        return address.is_global and not blocked


class _Blocked(Exception):
    """A connection the policy refuses (raised inside the connection pool)."""


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """The network under the fetcher's pool: resolves the host itself, keeps only the
    addresses the policy allows, and connects to one of those very addresses (TLS still
    verifies the certificate against the host name)."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        if not self.policy.host_allowed(host):  # the pool's own reading of the URL, again
            raise _Blocked(f"the host '{host}' is not an allowed media domain")
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            raise httpcore.ConnectError(f"the host '{host}' could not be resolved") from None
        found = list(dict.fromkeys(str(info[4][0]) for info in infos))
        allowed = [a for a in found if self.policy.address_allowed(_address(a))]
        if not allowed:
            raise _Blocked(
                f"the host '{host}' resolves to {found[0]}, a private, loopback, link-local, "
                "multicast or reserved address"
            )
        error: Exception = httpcore.ConnectError(f"could not connect to '{host}'")
        for address in allowed:
            try:
                return await self.inner.connect_tcp(address, port, timeout, local_address)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise _Blocked("unix sockets are never fetched")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def _address(text: str) -> IPAddress:
    return ipaddress.ip_address(text.split("%", 1)[0])  # an IPv6 zone does not change it


class MediaFetcher:
    """Fetches allowed image URLs as data URLs under a :class:`MediaPolicy`.

    One per process; :meth:`data_url` may run concurrently (each fetch has its own
    connections, closed when it ends)."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self._ssl = ssl.create_default_context()

    async def data_url(self, url: str, param: str) -> str:
        """The image at ``url`` as a ``data:`` URL; InvalidRequestError naming ``param`` for
        a URL the policy refuses or a fetch that fails."""
        if not self.policy.enabled:
            raise _refused(param, "image URLs are not fetched here (no allowed media domains)")
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                raw = await self._follow(url, param)
        except TimeoutError:
            raise _refused(
                param, f"fetching the image took longer than {self.policy.timeout_s:g} s"
            ) from None
        mime = image_type(raw)
        if mime is None:
            raise _refused(param, "the fetched data is not a PNG, JPEG, WebP or GIF image")
        return f"data:{mime};base64," + base64.b64encode(raw).decode("ascii")

    async def _follow(self, url: str, param: str) -> bytes:
        backend = _CheckedBackend(self.policy)
        async with httpcore.AsyncConnectionPool(
            ssl_context=self._ssl, network_backend=backend, retries=0
        ) as pool:
            for _ in range(MAX_REDIRECTS + 1):
                request = self._request(url, param)
                try:
                    status, location, body = await self._get(pool, request, param)
                except _Blocked as exc:
                    raise _refused(param, str(exc)) from None
                except httpcore.TimeoutException:
                    raise TimeoutError from None
                except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
                    raise _refused(param, f"the image could not be fetched ({exc})") from None
                if status in _REDIRECTS and location is not None:
                    url = urljoin(url, location)
                    continue
                if status != 200:
                    raise _refused(param, f"the image's server answered HTTP {status}")
                return body
        raise _refused(param, f"more than {MAX_REDIRECTS} redirects")

    def _request(self, url: str, param: str) -> httpcore.Request:
        """The GET for ``url``, built from our own reading of it (the pool never parses the
        client's string), after the scheme, userinfo and host checks."""
        if any(c in url for c in "\\\t\r\n ") or not url.isascii():
            raise _refused(param, "the URL has characters a URL may not carry")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise _refused(param, "only http and https URLs are fetched")
        if "@" in parts.netloc:
            raise _refused(param, "a URL with a userinfo part (user@host) is not fetched")
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            raise _refused(param, "the URL's port is not a number in 0-65535") from None
        if not host:
            raise _refused(param, "the URL names no host")
        if not self.policy.host_allowed(host):
            raise _refused(param, f"the host '{host}' is not an allowed media domain")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = [
            (b"Host", parts.netloc.encode("ascii")),
            (b"Accept", b"image/*"),
            (b"Accept-Encoding", b"identity"),
            (b"User-Agent", b"portico-media-fetch"),
        ]
        origin = httpcore.URL(
            scheme=parts.scheme.encode("ascii"),
            host=host.encode("ascii"),
            port=port,
            target=target.encode("ascii"),
        )
        return httpcore.Request(b"GET", origin, headers=headers)

    async def _get(
        self, pool: httpcore.AsyncConnectionPool, request: httpcore.Request, param: str
    ) -> tuple[int, str | None, bytes]:
        """(status, Location header, body): the body read only for a 200, up to the cap."""
        cap = self.policy.max_bytes
        response = await pool.handle_async_request(request)
        try:
            headers = {k.lower(): v for k, v in response.headers}
            if response.status != 200:
                location = headers.get(b"location")
                text = None if location is None else location.decode("latin-1")
                return response.status, text, b""
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > cap:
                raise _refused(param, f"the image is larger than {cap} bytes")
            chunks, size = [], 0
            async for chunk in response.aiter_stream():  # type: ignore[union-attr]
                size += len(chunk)
                if size > cap:
                    raise _refused(param, f"the image is larger than {cap} bytes")
                chunks.append(chunk)
            return 200, None, b"".join(chunks)
        finally:
            await response.aclose()


def _refused(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid value for '{param}': {why}.", param=param)
