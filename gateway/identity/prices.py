"""Per-model prices: what one million tokens of a model cost, in USD, and a request's spend.

Prices come from two places: the gateway config (``pricing:``, one entry per model name, local
engines and remote tiers alike) and the admin API (``PUT /admin/v1/prices/{model}``), which
stores an override in Redis. An override wins over the config; deleting it brings the config's
price back. A model with no price costs nothing (a local model nobody bills for).

Money is integer arithmetic end to end: a price is held as micro-dollars per million tokens
(``ModelPrice.units``), a request's spend is computed once in micro-dollars (rounded half up)
and summed in Redis with ``INCRBY``, so no float ever accumulates.

Layout: ``portico:prices`` HASH, field = model name, value = the price as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from functools import cached_property
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.store import RedisClient

log = logging.getLogger(__name__)

PRICES_KEY = "portico:prices"
MICRO = 1_000_000
# USD per 1M tokens: finite, non-negative, at most a million dollars (a typo guard)
Price = Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False)]


def usd_to_micro(usd: float) -> int:
    """Dollars as integer micro-dollars, from the decimal the user wrote (``0.15`` is 150000,
    not 149999.99...); rounded half up."""
    return int((Decimal(repr(usd)) * MICRO).quantize(Decimal(1), rounding=ROUND_HALF_UP))


class ModelPrice(BaseModel):
    """A model's price in USD per 1M tokens; ``cached_input`` (prompt tokens the engine read
    from its prefix cache) defaults to ``input``; ``image`` is USD per input image (LiteLLM's
    ``input_cost_per_image``), charged on top of the image's prompt tokens; absent: images
    cost only their tokens. Body of ``PUT /admin/v1/prices/{model}`` and an entry of the
    config's ``pricing:``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    input: Price
    cached_input: Price | None = None
    output: Price
    image: Price | None = None  # USD per image, not per 1M tokens

    @cached_property
    def image_units(self) -> int:
        """Micro-dollars per input image (0 when images cost only their tokens)."""
        return 0 if self.image is None else usd_to_micro(self.image)

    @cached_property  # once per price: Decimal is slow, and this is on every request's path
    def units(self) -> tuple[int, int, int]:
        """(input, cached input, output) in micro-dollars per 1M tokens."""
        cached = self.input if self.cached_input is None else self.cached_input
        return usd_to_micro(self.input), usd_to_micro(cached), usd_to_micro(self.output)

    def spend_micro_usd(
        self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, num_images: int = 0
    ) -> int:
        """Spend of one request in micro-dollars, rounded half up once.

        ``prompt_tokens`` includes the cached ones (OpenAI's usage: ``cached_tokens`` is a
        detail of ``prompt_tokens``): uncached = prompt - cached, each priced at its rate;
        each of ``num_images`` input images adds the image price.
        """
        # comparisons, not min/max calls: this runs once per request
        prompt = prompt_tokens if prompt_tokens > 0 else 0
        cached = cached_tokens if cached_tokens > 0 else 0
        if cached > prompt:
            cached = prompt
        completion = completion_tokens if completion_tokens > 0 else 0
        input_units, cached_units, output_units = self.units
        # tokens x micro-dollars per 1M tokens = micro-dollars x 1e6: divide once, at the end
        total = (prompt - cached) * input_units + cached * cached_units + completion * output_units
        if num_images > 0:
            total += num_images * self.image_units * MICRO
        return (total + MICRO // 2) // MICRO

    def public(self) -> dict[str, float]:
        cached = self.input if self.cached_input is None else self.cached_input
        out = {"input": self.input, "cached_input": cached, "output": self.output}
        if self.image is not None:  # USD per image (per_tokens does not apply to it)
            out["image"] = self.image
        return out


@dataclass(frozen=True, slots=True)
class PriceEntry:
    """An effective price and where it comes from."""

    model: str
    price: ModelPrice
    source: Literal["config", "admin"]

    def public(self) -> dict[str, object]:
        return {
            "object": "model_price",
            "model": self.model,
            "currency": "usd",
            "per_tokens": 1_000_000,
            **self.price.public(),
            "source": self.source,
        }


class PriceBook:
    """The effective prices of every model: the config's, overridden by the admin API's.

    Lookups (:meth:`get`, :meth:`spend_micro_usd`) read memory only, so the request path never
    waits on Redis for a price. This replica sees its own admin writes at once and another
    replica's within ``refresh_s`` (:meth:`start` runs the refresh loop). Safe across asyncio
    tasks of one event loop.
    """

    def __init__(
        self,
        redis: RedisClient,
        configured: Mapping[str, ModelPrice] | None = None,
        *,
        refresh_s: float = 5.0,
    ) -> None:
        self.redis = redis
        self._configured = dict(configured or {})
        self._overrides: dict[str, ModelPrice] = {}
        self._refresh_s = refresh_s
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def get(self, model: str) -> ModelPrice | None:
        price = self._overrides.get(model)
        return price if price is not None else self._configured.get(model)

    def spend_micro_usd(
        self,
        model: str,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        num_images: int = 0,
    ) -> int:
        """A request's spend on ``model`` in micro-dollars; 0 when the model has no price."""
        price = self.get(model)
        if price is None:
            return 0
        return price.spend_micro_usd(prompt_tokens, cached_tokens, completion_tokens, num_images)

    def entries(self) -> list[PriceEntry]:
        """Every effective price, sorted by model name."""
        out = {m: PriceEntry(m, p, "config") for m, p in self._configured.items()}
        out.update({m: PriceEntry(m, p, "admin") for m, p in self._overrides.items()})
        return [out[m] for m in sorted(out)]

    def entry(self, model: str) -> PriceEntry | None:
        if model in self._overrides:
            return PriceEntry(model, self._overrides[model], "admin")
        if model in self._configured:
            return PriceEntry(model, self._configured[model], "config")
        return None

    async def refresh(self) -> None:
        """Read the admin overrides from Redis (one HGETALL); a bad stored entry is skipped."""
        raw = await self.redis.hgetall(PRICES_KEY)
        overrides: dict[str, ModelPrice] = {}
        for field, value in raw.items():
            model = field.decode() if isinstance(field, bytes) else str(field)
            try:
                overrides[model] = ModelPrice.model_validate_json(value)
            except ValidationError:
                log.warning("ignoring an invalid stored price for model %r", model)
        self._overrides = overrides

    async def put(self, model: str, price: ModelPrice) -> PriceEntry:
        await self.redis.hset(PRICES_KEY, model, json.dumps(price.model_dump(exclude_none=True)))
        self._overrides[model] = price
        return PriceEntry(model, price, "admin")

    async def delete(self, model: str) -> bool:
        """Drop the admin override of ``model``; True when there was one."""
        removed = int(await self.redis.hdel(PRICES_KEY, model))
        self._overrides.pop(model, None)
        return removed > 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # Redis down: keep the last prices, try again later
                log.debug("refreshing prices failed: %s", exc)

    async def aclose(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None
