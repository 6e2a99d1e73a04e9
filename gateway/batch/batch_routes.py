"""``/v1/files`` and ``/v1/batches`` as the OpenAI SDK calls them, per tenant.

Every route authenticates the caller with the gateway's one resolver and reads or writes only
the caller's tenant's files and batches (another tenant's id is a 404). Creating a batch checks
what can be checked at once (the endpoint, the completion window, the input file, its line
count, the tenant's unfinished batches) and hands the batch to the runner
(batch/batch_runner.py); each line is checked when it is sent, and a bad one goes to the
error file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from gateway.batch.batches import (
    BATCH_ENDPOINTS,
    BatchSettings,
    BatchStore,
    Owner,
    completion_window_s,
    read_lines,
)
from gateway.batch.files import FileStore, read_upload
from gateway.identity.principal import Principal
from portico.errors import APIError, InvalidRequestError

MAX_METADATA_PAIRS = 16


class ConflictError(APIError):
    status_code = 409
    error_type = "invalid_request_error"
    default_code = "batch_not_cancellable"


def build_batch_router(
    files: FileStore,
    batches: BatchStore,
    settings: BatchSettings,
    authenticate: Callable[[Request], Awaitable[Principal]],
    wake: Callable[[], None],
) -> APIRouter:
    """The Files and Batch API routes; ``wake`` tells the runner a batch was created or
    cancelled here."""
    router = APIRouter()

    @router.post("/v1/files")
    async def create_file(request: Request) -> JSONResponse:
        principal = await authenticate(request)
        body = await request.body()
        filename, purpose, content = read_upload(
            request.headers.get("content-type", ""), body, settings.max_file_bytes
        )
        return JSONResponse(await files.create(principal.tenant_id, filename, purpose, content))

    @router.get("/v1/files")
    async def list_files(request: Request) -> JSONResponse:
        principal = await authenticate(request)
        return JSONResponse(await files.list_page(principal.tenant_id, request.query_params))

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str) -> JSONResponse:
        principal = await authenticate(request)
        return JSONResponse(await files.get(principal.tenant_id, file_id))

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> JSONResponse:
        principal = await authenticate(request)
        return JSONResponse(await files.delete(principal.tenant_id, file_id))

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        principal = await authenticate(request)
        content = await files.content(principal.tenant_id, file_id)
        return Response(content, media_type="application/octet-stream")

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        principal = await authenticate(request)
        fields = _batch_fields(await request.body())
        meta = await files.get(principal.tenant_id, fields["input_file_id"])
        if meta["purpose"] != "batch":
            raise InvalidRequestError(
                "The input file's purpose must be 'batch'.", param="input_file_id"
            )
        content = await files.content(principal.tenant_id, fields["input_file_id"])
        num_lines = len(read_lines(content))
        if not 0 < num_lines <= settings.max_lines_per_batch:
            raise InvalidRequestError(
                f"The input file has {num_lines} lines; a batch takes 1 to "
                f"{settings.max_lines_per_batch}.",
                param="input_file_id",
                code="invalid_line_count",
            )
        owner = Owner(principal.tenant_id, principal.key_id, principal.subject)
        batch = await batches.create(owner, fields, num_lines, settings.max_batches_per_tenant)
        wake()
        return JSONResponse(batch)

    @router.get("/v1/batches")
    async def list_batches(request: Request) -> JSONResponse:
        principal = await authenticate(request)
        return JSONResponse(await batches.page(principal.tenant_id, request.query_params))

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str) -> JSONResponse:
        principal = await authenticate(request)
        return JSONResponse(await batches.view(principal.tenant_id, batch_id))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
        principal = await authenticate(request)
        tenant = principal.tenant_id
        batch = await batches.load(tenant, batch_id)
        if batch["status"] not in ("cancelling", "cancelled"):
            now = str(int(time.time()))
            moved = await batches.transition(
                tenant,
                batch_id,
                ("validating", "in_progress"),
                status="cancelling",
                cancelling_at=now,
            )
            if not moved:
                raise ConflictError(
                    f"Cannot cancel a batch with status '{batch['status']}'.", param="batch_id"
                )
            wake()
        return JSONResponse(await batches.view(tenant, batch_id))

    return router


def _batch_fields(raw: bytes) -> dict[str, Any]:
    """The create request's fields, checked (a 400 names the bad one)."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise InvalidRequestError("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise InvalidRequestError(
            "Missing required parameter: 'input_file_id'.", param="input_file_id"
        )
    endpoint = body.get("endpoint")
    if endpoint not in BATCH_ENDPOINTS:
        raise InvalidRequestError(
            f"Invalid value for 'endpoint': one of {', '.join(BATCH_ENDPOINTS)}.",
            param="endpoint",
        )
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA_PAIRS
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise InvalidRequestError(
            f"Invalid value for 'metadata': at most {MAX_METADATA_PAIRS} string pairs.",
            param="metadata",
        )
    window = body.get("completion_window", "24h")
    return {
        "input_file_id": file_id,
        "endpoint": endpoint,
        "completion_window": window,
        "window_s": completion_window_s(window),
        "metadata": metadata,
    }
