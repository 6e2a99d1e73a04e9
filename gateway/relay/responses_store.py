"""Stored Responses API responses, per tenant, in the gateway's Redis.

``store: true`` (OpenAI's default) keeps a response for ``retention_s`` (OpenAI keeps them 30
days): the response object (``GET /v1/responses/{id}``) and the conversation that led to it
(the input items the engine got, earlier turns included, then the response's output items),
which is what ``previous_response_id`` continues. The key holds the tenant
(``portico:responses:{tenant}:{id}``, the tenant as the hash tag so a tenant's keys share a
Redis Cluster slot): a tenant can read, chain or delete only its own responses; any other id
is a 404, exactly as an id that never existed.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.body.fields import RequestFields, input_items, turns_of
from gateway.relay.proxy import Exchange
from gateway.relay.usage_relay import Usage
from gateway.store import RedisClient
from portico.errors import InvalidRequestError, NotFoundError

log = logging.getLogger("portico.gateway.responses")

DEFAULT_RETENTION_S = 30 * 24 * 3600


@dataclass(frozen=True)
class StoredResponse:
    """A response as kept: the object clients read, and the conversation it ended."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]

    @property
    def input_items(self) -> list[dict[str, Any]]:
        """The items the response answered (earlier turns included), oldest first."""
        num_output = len(self.response.get("output") or [])
        return self.conversation[: len(self.conversation) - num_output]


def stored_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id, and a message as ``type: "message"``
    with text parts (the engine reads both forms alike)."""
    item = dict(item)
    if item.get("type", "message") == "message":
        item["type"] = "message"
        if isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
    item.setdefault("id", f"msg_{uuid.uuid4().hex}")
    return item


class ResponseStore:
    """Save, load and delete stored responses of a tenant (one Redis string per response)."""

    def __init__(self, redis: RedisClient, retention_s: int = DEFAULT_RETENTION_S) -> None:
        self.redis = redis
        self.retention_s = retention_s

    @staticmethod
    def key(tenant_id: str, response_id: str) -> str:
        return f"portico:responses:{{{tenant_id}}}:{response_id}"

    async def save(
        self, tenant_id: str, response: dict[str, Any], input_items: list[dict[str, Any]]
    ) -> None:
        """Keep ``response`` and its conversation (``input_items`` + the response's output)."""
        output = [item for item in response.get("output") or [] if isinstance(item, dict)]
        # Every stored item gets an id (as OpenAI's input items have): an id the client chose
        # stays; the engine ignores ids when the conversation is sent again.
        named = [stored_item(item) for item in input_items]
        record = {"response": response, "conversation": [*named, *output]}
        await self.redis.set(
            self.key(tenant_id, str(response["id"])), json.dumps(record), ex=self.retention_s
        )

    async def load(
        self, tenant_id: str, response_id: str, param: str | None = None
    ) -> StoredResponse:
        """The stored response, or a 404 (another tenant's id reads as no id at all)."""
        raw = await self.redis.get(self.key(tenant_id, response_id))
        if raw is None:
            raise NotFoundError(
                f"No response with id '{response_id}' was found.",
                param=param,
                code="response_not_found",
            )
        record = json.loads(raw)
        return StoredResponse(record["response"], record["conversation"])

    async def delete(self, tenant_id: str, response_id: str) -> None:
        """Forget a stored response, or a 404 when there is none."""
        if not await self.redis.delete(self.key(tenant_id, response_id)):
            raise NotFoundError(
                f"No response with id '{response_id}' was found.",
                code="response_not_found",
            )


class ResponseChain:
    """One Responses request's side of the store: the conversation it continues (the
    ``previous_response_id`` expanded into ``input``) and, once answered, keeping the answer.

    ``prepare`` runs before admission so the earlier turns count as prompt tokens; ``keep_body``
    (whole answer) and ``keeping_stream`` (the stream's ``response.completed``) save before the
    client can see the end of the response, so a ``GET`` right after finds it.
    """

    def __init__(self, store: ResponseStore, tenant_id: str, fields: RequestFields) -> None:
        self.store = store
        self.tenant_id = tenant_id
        self.fields = fields
        self.items: list[dict[str, Any]] = []
        self.wants_store = fields.body.get("store", True) is not False

    async def prepare(self) -> None:
        fields = self.fields
        self.items = input_items(fields.body.get("input"))
        previous = fields.body.get("previous_response_id")
        if previous is None:
            return
        if not isinstance(previous, str) or not previous:
            raise InvalidRequestError(
                "Invalid value for 'previous_response_id': must be a string.",
                param="previous_response_id",
            )
        stored = await self.store.load(self.tenant_id, previous, "previous_response_id")
        self.items = [*stored.conversation, *self.items]
        fields.body["input"] = self.items
        fields.body["previous_input_included"] = True
        system = [m for m in fields.messages or () if m.get("role") == "system"][:1]
        fields.messages = [*system, *turns_of(self.items)]
        fields.edited = True

    async def keep(self, response: Any) -> None:
        if not self.wants_store or not isinstance(response, dict) or "id" not in response:
            return
        try:
            await self.store.save(self.tenant_id, response, self.items)
        except Exception as exc:  # the answer is given either way; only the copy is lost
            log.warning("storing response %s failed: %s", response.get("id"), exc)

    async def follow(self, exchange: Exchange) -> None:
        """Keep the response of a successful ``exchange``: its whole body, or its stream's,
        saved by the block that completes it (the first, or one of ``rest`` as it is
        relayed)."""
        if exchange.body is not None:
            await self.keep_body(exchange.body)
            return
        await self.keep_first(exchange.usage)
        if exchange.rest is not None:
            exchange.rest = self.keeping_stream(exchange.rest, exchange.usage)

    async def keep_first(self, usage: Usage) -> None:
        """Save a stream that its first block already completed (a short answer arrives whole)
        before that block is sent."""
        if usage.response is not None:
            await self.keep(usage.response)

    async def keep_body(self, body: bytes) -> None:
        try:
            response = json.loads(body)
        except ValueError:
            return
        await self.keep(response)

    async def keeping_stream(
        self, blocks: AsyncIterator[bytes], usage: Usage
    ) -> AsyncIterator[bytes]:
        """Relay ``blocks``; the block that completed the response waits for its save. (A
        stream whose first block already completed it was saved by :meth:`keep_first`.)"""
        kept = usage.response is not None
        async for block in blocks:
            if not kept and usage.response is not None:
                kept = True
                await self.keep(usage.response)
            yield block


def page_limit(query: Mapping[str, str]) -> int:
    """An OpenAI list page's ``limit``: 1 to 100, 20 when absent; 400 naming it otherwise."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequestError("Invalid value for 'limit': 1 to 100.", param="limit")
    return limit


def input_items_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: OpenAI's list page (``order`` desc by default,
    ``limit`` 1-100, default 20, ``after`` an item id)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("Invalid value for 'order': asc or desc.", param="order")
    limit = page_limit(query)
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise InvalidRequestError(f"No input item with id '{after}'.", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(ordered) > limit,
    }
