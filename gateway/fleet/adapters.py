"""LoRA adapters as models the gateway serves: who may see each, and which engines hold it.

An adapter has a name (what clients send as ``model``), the base model whose engines serve it,
a folder on the server, and an owner: ``tenant_id`` None is shared (every tenant whose plan
allows it), otherwise it is private to that tenant. To any other tenant a private adapter does
not exist: :meth:`AdapterCatalog.resolve` answers None exactly as for an unknown name, so the
caller's 404 ``model_not_found`` is byte for byte the one for a model that was never there.

The catalog lives in Redis (one hash, so every gateway replica sees the same adapters) and in
memory. Registering loads the adapter into every healthy replica of its base model through the
engine's ``POST /v1/load_lora_adapter`` (the engines run with ``--enable-lora`` and runtime
updates allowed); an engine's refusal (rank too high, unknown module) is the admin's 400 and
nothing is kept. Removing unloads it. :meth:`lacking` names the replicas that do not hold an
adapter, so routing can prefer the ones that do.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from gateway.fleet.pool import Pool, Replica
from gateway.identity.principal import Principal
from portico.errors import InvalidRequestError, NotFoundError

log = logging.getLogger("portico.gateway.adapters")

REDIS_KEY = "portico:lora_adapters"


@dataclass(frozen=True)
class Adapter:
    """One registered adapter (``tenant_id`` None: shared)."""

    name: str
    base_model: str
    path: str
    tenant_id: str | None = None

    def visible_to(self, principal: Principal) -> bool:
        return self.tenant_id is None or self.tenant_id == principal.tenant_id

    def allowed_for(self, principal: Principal) -> bool:
        """The plan allows the adapter by its own name or by its base model's."""
        return principal.may_use(self.name) or principal.may_use(self.base_model)


@dataclass(eq=False)
class AdapterCatalog:
    """The adapters of this gateway; see the module docstring. One event loop, no locks."""

    redis: Any
    pools: dict[str, Pool]
    reserved: set[str] = field(default_factory=set)  # served models, aliases, "auto"
    adapters: dict[str, Adapter] = field(default_factory=dict)
    loaded_on: dict[str, set[str]] = field(default_factory=dict)  # adapter -> replica names

    async def load(self) -> None:
        """Read the catalog from Redis and load each adapter into its engines."""
        raw = await self.redis.hgetall(REDIS_KEY)
        for value in raw.values():
            adapter = Adapter(**json.loads(value))
            if adapter.base_model in self.pools:
                self.adapters[adapter.name] = adapter
        await asyncio.gather(
            *(self._load_everywhere(a, strict=False) for a in self.adapters.values())
        )

    # -- lookups (the request path) ----------------------------------------------------------

    def resolve(self, name: str, principal: Principal) -> Adapter | None:
        """The adapter ``name`` names for this caller; None if none exists *for them*."""
        adapter = self.adapters.get(name)
        if adapter is None or not adapter.visible_to(principal):
            return None
        return adapter

    def visible(self, principal: Principal) -> list[Adapter]:
        return [
            a
            for _, a in sorted(self.adapters.items())
            if a.visible_to(principal) and a.allowed_for(principal)
        ]

    def lacking(self, adapter: Adapter) -> tuple[Replica, ...]:
        """Replicas of the base model that do not hold ``adapter`` (routing avoids them)."""
        held = self.loaded_on.get(adapter.name, set())
        return tuple(r for r in self.pools[adapter.base_model].replicas if r.name not in held)

    # -- admin -------------------------------------------------------------------------------

    async def register(self, adapter: Adapter) -> Adapter:
        """Load ``adapter`` into its base model's engines and keep it (400 when refused)."""
        if adapter.name in self.adapters or adapter.name in self.reserved:
            raise InvalidRequestError(
                f"The name '{adapter.name}' is already a model or an adapter.",
                param="name",
                code="adapter_exists",
            )
        if adapter.base_model not in self.pools:
            raise InvalidRequestError(
                f"'{adapter.base_model}' is not a model served by local engines.",
                param="base_model",
            )
        await self._load_everywhere(adapter, strict=True)
        self.adapters[adapter.name] = adapter
        await self.redis.hset(REDIS_KEY, adapter.name, json.dumps(asdict(adapter)))
        return adapter

    async def remove(self, name: str) -> Adapter:
        """Forget ``name`` and unload it from every engine (404 if unknown)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise NotFoundError(f"No adapter named '{name}'.", param="name", code="not_found")
        await self.redis.hdel(REDIS_KEY, name)
        held = self.loaded_on.pop(name, set())
        replicas = [r for r in self.pools[adapter.base_model].replicas if r.name in held]
        await asyncio.gather(*(self._unload(r, name) for r in replicas))
        return adapter

    # -- engines -----------------------------------------------------------------------------

    def replica_changed(
        self, pool: str, replica: Replica, ready: bool
    ) -> asyncio.Task[None] | None:
        """An engine went down (it holds nothing now) or became ready (load its pool's
        adapters into it; until then routing avoids it for those adapters)."""
        for held in self.loaded_on.values():
            held.discard(replica.name)
        wanted = [a for a in self.adapters.values() if a.base_model == pool]
        if not ready or not wanted:
            return None

        async def sync() -> None:
            for adapter in wanted:
                error = await self._load(replica, adapter)
                if error is None and adapter.name in self.adapters:
                    self.loaded_on.setdefault(adapter.name, set()).add(replica.name)
                elif error is not None:
                    log.warning(
                        "engine %s refused adapter %s: %s", replica.name, adapter.name, error
                    )

        return asyncio.get_running_loop().create_task(sync())

    async def _load_everywhere(self, adapter: Adapter, *, strict: bool) -> None:
        replicas = self.pools[adapter.base_model].healthy()
        results = await asyncio.gather(*(self._load(r, adapter) for r in replicas))
        held = {r.name for r, error in zip(replicas, results, strict=True) if error is None}
        refusals = [e for e in results if e is not None]
        if strict and (refusals or not replicas):
            for replica in replicas:
                if replica.name in held:
                    await self._unload(replica, adapter.name)
            message = refusals[0] if refusals else "no healthy engine of the base model"
            raise InvalidRequestError(
                f"The engines refused adapter '{adapter.name}': {message}",
                param="path",
                code="invalid_lora",
            )
        self.loaded_on[adapter.name] = held

    @staticmethod
    async def _load(replica: Replica, adapter: Adapter) -> str | None:
        """None when the engine holds the adapter, else why not."""
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        try:
            r = await replica.client.post("/v1/load_lora_adapter", json=body)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__} from {replica.name}"
        if r.status_code == 200:
            return None
        try:
            message = str(r.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {r.status_code}"
        if "already been loaded" in message:
            return None
        return message

    @staticmethod
    async def _unload(replica: Replica, name: str) -> None:
        try:
            await replica.client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        except httpx.HTTPError as exc:
            log.warning("unloading adapter %s from %s failed: %s", name, replica.name, exc)
