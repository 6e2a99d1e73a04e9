"""Remote upstreams: their configuration (:class:`RemoteSpec`), and the ones that need
translation (Anthropic, Bedrock, Vertex, Cohere, ...) reached through ``litellm``.

OpenAI-compatible remotes (``openai/...``, ``azure/...``: hosted OpenAI, vLLM, another Portico,
Azure OpenAI) do not come here: they go over the gateway's own transport like engines
(``gateway/remotes/openai_remote.py``); litellm costs milliseconds of CPU per request
(docs/benchmarks.md). ``api: litellm`` forces this path for any model.

A remote tier answers in OpenAI's shape like a local pool does, so the rest of the gateway
cannot tell them apart: ``RemoteUpstream.exchange`` has the same signature and the same retry
rule (connect errors, timeouts, 429/502/503/504, only before the first byte) as
:class:`gateway.relay.proxy.LocalUpstream`. ``litellm`` is imported when the first remote
upstream is built, with its model-price map taken from the package (it must not reach the network).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.body.fields import RequestFields
from gateway.fleet.pool import Replica
from gateway.identity.principal import Principal
from gateway.metrics import GatewayMetrics
from gateway.relay.proxy import Exchange
from gateway.relay.retry import RetryPolicy
from gateway.relay.usage_relay import DONE_EVENT, Usage, _dumps, error_event
from portico.errors import error_body, status_error_type

log = logging.getLogger("portico.gateway.remote")

# OpenAI request fields a remote upstream receives (the rest stays at the gateway).
PASSED_FIELDS = (
    "temperature",
    "top_p",
    "n",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "user",
    "seed",
    "tools",
    "tool_choice",
    "response_format",
    "parallel_tool_calls",
    "echo",
    "suffix",
    "best_of",
)


def redact(text: str, *secrets: str | None) -> str:
    """``text`` with every given secret (and its last 8 characters, which providers echo in
    their "incorrect API key" messages) replaced by ``***``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
            if len(secret) > 16:
                text = text.replace(secret[-8:], "***")
    return text


class RemoteSpec(BaseModel):
    """One remote upstream (``remotes:`` in the gateway config; docs/configuration.md).

    ``api`` decides the path: ``openai`` and ``azure`` go over the gateway's lean transport,
    ``litellm`` through litellm; left out, it follows the ``model`` prefix (``openai/`` and
    ``azure/`` lean, anything else litellm).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:/-]+$")  # the model clients name
    model: str = Field(min_length=1)  # "openai/gpt-4o-mini", "azure/<deployment>", "anthropic/..."
    api: Literal["openai", "azure", "litellm"] | None = None
    api_base: str | None = None
    api_version: str | None = None  # Azure OpenAI's api-version query parameter
    api_key_env: str | None = None  # the environment variable holding the provider's key
    api_key_file: Path | None = None  # or a secrets file holding it (a mounted secret)
    tenant_keys: bool = False  # a tenant's own provider key (admin API) replaces the configured
    timeout_s: float = Field(default=60.0, gt=0, le=3600)
    connect_timeout_s: float = Field(default=5.0, gt=0, le=600)
    keepalive_expiry_s: float = Field(default=4.0, gt=0, le=3600)
    http2: bool = False
    ca_file: Path | None = None
    client_cert_file: Path | None = None
    client_key_file: Path | None = None
    send_cache_salt: bool = False
    tokenizer: str | None = None  # counts output tokens when the provider reports no usage

    @model_validator(mode="after")
    def _consistent(self) -> RemoteSpec:
        kind = self.kind
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("api_key_env and api_key_file: set one of them")
        if kind == "azure" and (self.api_base is None or self.api_version is None):
            raise ValueError("api azure needs api_base (https://<resource>.openai.azure.com) "
                             "and api_version")  # fmt: skip
        if self.api_base is not None and not self.api_base.startswith(("http://", "https://")):
            raise ValueError("api_base must start with http:// or https://")
        if self.client_key_file is not None and self.client_cert_file is None:
            raise ValueError("client_key_file needs client_cert_file")
        lean_only = ("http2", "ca_file", "client_cert_file", "send_cache_salt", "tokenizer")
        if kind == "litellm" and any(name in self.model_fields_set for name in lean_only):
            raise ValueError(f"{', '.join(lean_only)}: only for api openai or azure")
        for name in ("api_key_file", "ca_file", "client_cert_file", "client_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")
        return self

    @property
    def kind(self) -> Literal["openai", "azure", "litellm"]:
        if self.api is not None:
            return self.api
        prefix = self.model.split("/", 1)[0]
        return prefix if prefix in ("openai", "azure") else "litellm"  # type: ignore[return-value]

    @property
    def upstream_model(self) -> str:
        """The provider's name of the model (the Azure deployment): ``model`` less its prefix."""
        prefix, sep, rest = self.model.partition("/")
        return rest if sep and prefix in ("openai", "azure") else self.model

    def api_key(self, env: Mapping[str, str]) -> str | None:
        """The configured provider key (env or secrets file); ValueError naming the variable
        or file, never showing the value, when it is configured but missing."""
        if self.api_key_file is not None:
            key = Path(self.api_key_file).read_text().strip()
            if not key:
                raise ValueError(f"remotes {self.name}: api_key_file {self.api_key_file} is empty")
            return key
        if self.api_key_env is not None:
            key = env.get(self.api_key_env, "").strip()
            if not key:
                raise ValueError(
                    f"remotes {self.name}: the environment variable {self.api_key_env} "
                    "(api_key_env) is not set"
                )
            return key
        return None


class RemoteUpstream:
    """A remote provider reached through litellm, answering as the model ``spec.name``."""

    def __init__(
        self,
        spec: RemoteSpec,
        policy: RetryPolicy,
        metrics: GatewayMetrics,
        env: Mapping[str, str] | None = None,
    ) -> None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        litellm.suppress_debug_info = True  # no "Give Feedback" banner in the gateway's log
        self.litellm = litellm
        self.spec = spec
        self.name = spec.name
        self.tenant_keys = spec.tenant_keys
        self.policy = policy
        self.metrics = metrics
        self.api_key = spec.api_key(os.environ if env is None else env)

    def payload(
        self,
        raw: bytes,
        fields: RequestFields,
        model: str,
        cache_salt: str | None,
        max_tokens: int | None,
    ) -> bytes:
        return raw  # litellm builds the provider's request from ``fields``

    async def exchange(
        self,
        path: str,
        payload: bytes,
        fields: RequestFields,
        request_id: str,
        prefix_key: bytes | None,
        avoid: tuple[Replica, ...] = (),  # a remote provider has no replicas to avoid
        credential: str | None = None,
        principal: Principal | None = None,  # never sent: the tenant is the gateway's business
    ) -> Exchange:
        started = time.monotonic()
        deadline = started + self.policy.deadline_s
        attempt = 0
        while True:
            attempt += 1
            try:
                exchange = await self._attempt(fields, request_id, credential)
                exchange.upstream_s = time.monotonic() - started
                exchange.attempts = attempt
                return exchange
            except Exception as exc:  # litellm maps every provider error to its own classes
                status = self._status_of(exc)
                retryable = status == 0 or self.policy.retries_status(status)
                delay = self.policy.backoff(attempt)
                if (
                    not retryable
                    or attempt >= self.policy.max_attempts
                    or time.monotonic() + delay > deadline
                ):
                    return self._error_exchange(exc, status, attempt, started, credential)
                self.metrics.retries.labels(self.spec.name, str(status or "connect")).inc()
                await asyncio.sleep(delay)

    def _status_of(self, exc: Exception) -> int:
        """The provider's HTTP status, or 0 when it was never reached (connect error, timeout).

        litellm reports an unreachable provider as a 500 ("Connection error") or 408; the cause
        chain still holds the transport error, which is what decides."""
        unreached = (
            self.litellm.APIConnectionError,
            self.litellm.Timeout,
            httpx.TransportError,
            openai.APIConnectionError,
        )
        cause: BaseException | None = exc
        for _ in range(8):
            if cause is None:
                break
            if isinstance(cause, unreached):
                return 0
            cause = cause.__cause__ or cause.__context__
        return int(getattr(exc, "status_code", 0) or 0)

    def _error_exchange(
        self,
        exc: Exception,
        status: int,
        attempt: int,
        started: float,
        credential: str | None = None,
    ) -> Exchange:
        status = status if 400 <= status < 600 else 502
        log.warning(
            "remote %s failed after %d attempt(s): %s",
            self.spec.name,
            attempt,
            redact(str(exc), self.api_key, credential),
        )
        message = f"The remote upstream '{self.spec.name}' failed: {type(exc).__name__}."
        code = "upstream_error"
        if status in (401, 403):  # the gateway's provider key, not the client's: our 502
            status, code = 502, "upstream_auth_error"
        body = _dumps(error_body(message, status_error_type(status), None, code))
        return Exchange(
            status,
            "application/json",
            body=body,
            attempts=attempt,
            upstream_s=time.monotonic() - started,
        )

    async def _attempt(
        self, fields: RequestFields, request_id: str, credential: str | None = None
    ) -> Exchange:
        kwargs: dict[str, Any] = {k: fields.body[k] for k in PASSED_FIELDS if k in fields.body}
        kwargs.update(
            model=self.spec.model,
            stream=fields.stream,
            timeout=self.spec.timeout_s,
            num_retries=0,
            extra_headers={"x-request-id": request_id},
        )
        if self.spec.api_base:
            kwargs["api_base"] = self.spec.api_base
        if credential or self.api_key:
            kwargs["api_key"] = credential or self.api_key
        if fields.stream:
            kwargs["stream_options"] = {"include_usage": True}
        if fields.kind == "chat":
            resp = await self.litellm.acompletion(messages=fields.messages, **kwargs)
        else:
            resp = await self.litellm.atext_completion(prompt=fields.prompt, **kwargs)
        if not fields.stream:
            data = resp.model_dump()
            data["model"] = self.spec.name
            exchange = Exchange(200, "application/json", body=_dumps(data))
            exchange.usage.take(data.get("usage"))
            return exchange
        chunks = resp.__aiter__()
        exchange = Exchange(200, "text/event-stream")
        first = await anext(chunks)  # inside the retry loop: nothing reached the client yet
        exchange.first = self._event(first, exchange.usage, fields.wants_usage) or b": ok\n\n"
        exchange.rest = self._relay(chunks, exchange.usage, fields.wants_usage)
        return exchange

    def _event(self, chunk: Any, usage: Usage, keep_usage: bool) -> bytes:
        data = chunk.model_dump(exclude_none=True)
        data["model"] = self.spec.name
        if data.get("usage"):
            usage.take(data["usage"])
            if not keep_usage:
                if not data.get("choices"):
                    return b""
                data.pop("usage")
        return b"data: " + _dumps(data) + b"\n\n"

    async def _relay(
        self, chunks: AsyncIterator[Any], usage: Usage, keep_usage: bool
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                event = self._event(chunk, usage, keep_usage)
                if event:
                    yield event
        except Exception as exc:  # a provider error mid-stream: end the stream cleanly
            log.warning(
                "remote %s stream broke: %s", self.spec.name, redact(str(exc), self.api_key)
            )
            yield error_event(f"The remote stream broke: {type(exc).__name__}.")
            return
        yield DONE_EVENT
