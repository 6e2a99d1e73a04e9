"""Runtime adapter loading: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

vLLM's routes and bodies, mounted only when runtime updates are allowed
(``--allow-runtime-lora-updating`` or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): anyone who can
reach the engine could otherwise make it read any folder on the host. A bad adapter (rank above
``--max-lora-rank``, a module the model lacks, an unreadable folder, a taken name) is a 400 that
says why, and nothing is registered.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from engine.lora import LoRAError
from engine.lora.manager import LoRAManager
from engine.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, parse_body
from portico.errors import InvalidRequestError, NotFoundError

RUNTIME_UPDATE_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed(flag: bool) -> bool:
    """The flag, or vLLM's environment variable set to a true value."""
    return flag or os.environ.get(RUNTIME_UPDATE_ENV, "").strip().lower() in ("1", "true")


def add_lora_routes(app: FastAPI, lora: LoRAManager) -> None:
    """Mount the two routes on ``app`` for the adapters of ``lora``."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = parse_body(LoadLoRAAdapterRequest, await request.body())
        try:  # reads the folder: off the event loop
            await asyncio.to_thread(
                lora.register, req.lora_name, req.lora_path, req.base_model_name
            )
        except LoRAError as exc:
            raise InvalidRequestError(str(exc), param="lora_path", code="invalid_lora") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = parse_body(UnloadLoRAAdapterRequest, await request.body())
        try:
            lora.unregister(req.lora_name)
        except KeyError:
            raise NotFoundError(
                f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name"
            ) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
