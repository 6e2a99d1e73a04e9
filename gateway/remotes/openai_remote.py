"""OpenAI-compatible remote upstreams over the gateway's own transport, like engines.

Hosted OpenAI, vLLM, another Portico, Azure OpenAI: anything that speaks OpenAI's API at a base
URL is one :class:`OpenAIRemoteUpstream`, a :class:`~gateway.relay.proxy.LocalUpstream`
whose pool holds the remote endpoint. So it gets exactly what engines get: keep-alive
connections (the lean HTTP/1.1 transport, or httpx's HTTP/2 transport with ``http2: true``),
per-upstream connect and read timeouts, retries before the first byte, ejection after
consecutive failures, streams relayed event by event, usage read for settlement. What differs
is only the edge of the request:

* the URL: ``{api_base}{path less /v1}`` (OpenAI), or
  ``{api_base}/openai/deployments/{deployment}{path less /v1}?api-version=...`` (Azure);
* the credential: ``Authorization: Bearer`` (OpenAI) or ``api-key`` (Azure), from the
  environment or a secrets file, or a tenant's own provider key; never logged, and an upstream
  401/403 (whose message may echo part of the key) reaches the client as a 502 of our own;
* the body: the provider's model name, no ``cache_salt`` unless ``send_cache_salt``;
* usage a provider does not report is counted (``gateway/relay/output_tokens.py``).

An ejected endpoint has no ``/health`` to probe: after the cool-down it is readmitted half-open,
so the next request is the probe and one more failure ejects it again.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping

import certifi
import httpx

from gateway.body.fields import RequestFields
from gateway.fleet.pool import Pool, Replica
from gateway.identity.principal import Principal
from gateway.metrics import GatewayMetrics
from gateway.relay.output_tokens import OutputCounter
from gateway.relay.proxy import Exchange, LocalUpstream
from gateway.relay.retry import RetryPolicy
from gateway.relay.transport import LeanTransport
from gateway.relay.usage_relay import _dumps, upstream_body
from gateway.remotes.remote import RemoteSpec
from portico.errors import error_body

log = logging.getLogger("portico.gateway.openai_remote")

OPENAI_BASE = "https://api.openai.com/v1"
USER_AGENT = "portico-gateway"
MAX_IDLE_CONNECTIONS = 256


def ssl_context(spec: RemoteSpec) -> ssl.SSLContext:
    """Verification on (the private CA of ``ca_file``, else certifi's roots), TLS 1.2+, and the
    client certificate when one is configured."""
    ctx = ssl.create_default_context(cafile=str(spec.ca_file or certifi.where()))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if spec.client_cert_file is not None:
        key = str(spec.client_key_file) if spec.client_key_file is not None else None
        ctx.load_cert_chain(str(spec.client_cert_file), key)
    return ctx


def build_transport(spec: RemoteSpec, url: httpx.URL) -> httpx.AsyncBaseTransport:
    """The lean transport to the endpoint, or httpx's (httpcore + h2) for ``http2``."""
    tls = url.scheme == "https"
    ctx = ssl_context(spec) if tls else None
    if spec.http2:
        return httpx.AsyncHTTPTransport(
            verify=ctx if ctx is not None else True,
            http2=True,
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=MAX_IDLE_CONNECTIONS,
                keepalive_expiry=spec.keepalive_expiry_s,
            ),
        )
    if ctx is not None:
        ctx.set_alpn_protocols(["http/1.1"])
    return LeanTransport(
        host=url.host,
        port=url.port or (443 if tls else 80),
        ssl_context=ctx,
        idle_timeout_s=spec.keepalive_expiry_s,
    )


class OpenAIRemoteUpstream(LocalUpstream):
    """One OpenAI-compatible remote (``remotes[]`` with api ``openai`` or ``azure``)."""

    local_engine = False  # providers report usage once, at the end (if at all)

    def __init__(
        self,
        spec: RemoteSpec,
        policy: RetryPolicy,
        metrics: GatewayMetrics,
        env: Mapping[str, str],
        *,
        counter: OutputCounter | None = None,
    ) -> None:
        self.spec = spec
        self.api_key = spec.api_key(env)
        self.tenant_keys = spec.tenant_keys
        self.azure = spec.kind == "azure"
        base = (spec.api_base or OPENAI_BASE).rstrip("/")
        if self.azure:
            base += f"/openai/deployments/{spec.upstream_model}"
        self.base = httpx.URL(base)
        transport = build_transport(spec, self.base)
        timeouts = httpx.Timeout(spec.timeout_s, connect=spec.connect_timeout_s)
        client = httpx.AsyncClient(transport=transport, timeout=timeouts)
        replica = Replica(
            f"{spec.name}-0", client, transport, timeouts.as_dict(), up=True, probe_path=None
        )
        pool = Pool(
            spec.name,
            [replica],
            eject_after_failures=policy.eject_after_failures,
            eject_cooldown_s=policy.eject_cooldown_s,
            on_eject=lambda r: metrics.ejections.labels(spec.name, r.name).inc(),
        )
        super().__init__(pool, policy, metrics, counter=counter or OutputCounter(None))
        self._urls: dict[str, httpx.URL] = {}
        # identity: the relay forwards the bytes as they come, so they must not be compressed
        self._headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "user-agent": USER_AGENT,
        }
        if self.api_key is not None:
            self._headers.update(self._auth(self.api_key))

    @property
    def client(self) -> httpx.AsyncClient:
        return self.pool.replicas[0].client

    def payload(
        self,
        raw: bytes,
        fields: RequestFields,
        model: str,
        cache_salt: str | None,
        max_tokens: int | None,
    ) -> bytes:
        salt = cache_salt if self.spec.send_cache_salt else None
        return upstream_body(raw, fields, self.spec.upstream_model, salt, max_tokens)

    def request_url(self, path: str) -> httpx.URL:
        url = self._urls.get(path)
        if url is None:  # parsed once per path
            url = httpx.URL(str(self.base) + path.removeprefix("/v1"))
            if self.azure:
                url = url.copy_merge_params({"api-version": self.spec.api_version or ""})
            self._urls[path] = url
        return url

    def _auth(self, key: str) -> dict[str, str]:
        return {"api-key": key} if self.azure else {"authorization": f"Bearer {key}"}

    def request_headers(
        self, request_id: str, credential: str | None, principal: Principal | None = None
    ) -> dict[str, str]:
        # never the engine hop's x-portico-* headers: the tenant is no business of a provider
        headers = {**self._headers, "x-request-id": request_id}
        if credential is not None:
            headers.update(self._auth(credential))
        return headers

    async def exchange(
        self,
        path: str,
        payload: bytes,
        fields: RequestFields,
        request_id: str,
        prefix_key: bytes | None,
        avoid: tuple[Replica, ...] = (),
        credential: str | None = None,
        principal: Principal | None = None,
    ) -> Exchange:
        exchange = await super().exchange(
            path, payload, fields, request_id, prefix_key, avoid, credential
        )
        if exchange.status in (401, 403) or (
            exchange.status >= 400 and self._leaks(exchange.body, credential)
        ):
            return self._refused(exchange)
        return exchange

    def _leaks(self, body: bytes | None, credential: str | None) -> bool:
        if not body:
            return False
        secrets = [s for s in (self.api_key, credential) if s]
        return any(s.encode() in body or s[-8:].encode() in body for s in secrets)

    def _refused(self, exchange: Exchange) -> Exchange:
        """The provider refused the gateway's credential, or its error echoed the key: the
        client gets our own 502 (its own key was fine; the provider's text stays here)."""
        log.warning(
            "remote %s answered %d to the gateway's credential", self.spec.name, exchange.status
        )
        message = (
            f"The remote upstream '{self.spec.name}' refused the gateway's credential "
            f"(status {exchange.status})."
        )
        body = _dumps(error_body(message, "upstream_error", None, "upstream_auth_error"))
        return Exchange(
            502,
            "application/json",
            body=body,
            upstream_s=exchange.upstream_s,
            attempts=exchange.attempts,
        )
