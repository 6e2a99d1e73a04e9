"""The OpenAI Files API's store, per tenant: file bytes on disk, metadata in Redis.

A file's bytes live under ``files_dir/<tenant>/<file id>`` (the gateway's data dir by default,
written to a temporary name and renamed, so a reader never sees half a file); its metadata (the
file object OpenAI returns) is one Redis string ``portico:files:{tenant}:<id>`` and the tenant's
listing one sorted set ``portico:files:{tenant}`` (score: creation time), the tenant as the hash
tag as everywhere in the store. Every read goes through the tenant: another tenant's file id is
a 404, exactly as an id that never existed. An S3-compatible store is not implemented: every
gateway replica that serves the Files API must share ``files_dir``.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import os
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.store import RedisClient
from portico.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError

_FILE_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,64}$")


def file_key(tenant_id: str, file_id: str) -> str:
    return f"portico:files:{{{tenant_id}}}:{file_id}"


def files_index_key(tenant_id: str) -> str:
    return f"portico:files:{{{tenant_id}}}"


def _not_found(file_id: str) -> NotFoundError:
    return NotFoundError(f"No such File object: {file_id}", param="id", code="file_not_found")


class FileStore:
    """Create, read, list and delete a tenant's files. Safe to share between coroutines: every
    write is a new file renamed into place plus single-key Redis commands."""

    def __init__(self, redis: RedisClient, files_dir: Path, max_file_bytes: int) -> None:
        self.redis = redis
        self.files_dir = files_dir
        self.max_file_bytes = max_file_bytes

    def path(self, tenant_id: str, file_id: str) -> Path:
        return self.files_dir / tenant_id / file_id

    async def create(
        self,
        tenant_id: str,
        filename: str,
        purpose: str,
        content: bytes,
        file_id: str | None = None,
    ) -> dict[str, Any]:
        """Store ``content`` as a new file of ``tenant_id`` (``file_id`` given: written again
        under that id, as a batch's output file is when finalizing is repeated)."""
        file_id = file_id or f"file-{uuid.uuid4().hex}"
        await asyncio.to_thread(self._write, self.path(tenant_id, file_id), content)
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(file_key(tenant_id, file_id), json.dumps(meta))
            pipe.zadd(files_index_key(tenant_id), {file_id: time.time()})
            await pipe.execute()
        return meta

    @staticmethod
    def _write(path: Path, content: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        with open(partial, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)

    async def get(self, tenant_id: str, file_id: str) -> dict[str, Any]:
        """The file object, or a 404 (also for another tenant's id)."""
        if not _FILE_ID.match(file_id):
            raise _not_found(file_id)
        raw = await self.redis.get(file_key(tenant_id, file_id))
        if raw is None:
            raise _not_found(file_id)
        meta: dict[str, Any] = json.loads(raw)
        return meta

    async def content(self, tenant_id: str, file_id: str) -> bytes:
        await self.get(tenant_id, file_id)
        try:
            return await asyncio.to_thread(self.path(tenant_id, file_id).read_bytes)
        except FileNotFoundError:
            raise _not_found(file_id) from None

    async def delete(self, tenant_id: str, file_id: str) -> dict[str, Any]:
        await self.get(tenant_id, file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(file_key(tenant_id, file_id))
            pipe.zrem(files_index_key(tenant_id), file_id)
            await pipe.execute()
        self.path(tenant_id, file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    async def list_page(self, tenant_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        """``GET /v1/files``: OpenAI's cursor page (``purpose``, ``order`` desc by default,
        ``limit`` 1-10000, ``after`` a file id)."""
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequestError("Invalid value for 'order': asc or desc.", param="order")
        limit = _limit(query, default=10_000, most=10_000)
        ids = [
            i.decode() if isinstance(i, bytes) else str(i)
            for i in await self.redis.zrange(
                files_index_key(tenant_id), 0, -1, desc=order == "desc"
            )
        ]
        after = query.get("after")
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        purpose = query.get("purpose")
        page: list[dict[str, Any]] = []
        raws = await self.redis.mget([file_key(tenant_id, i) for i in ids]) if ids else []
        has_more = False
        for raw in raws:
            if raw is None:
                continue
            meta = json.loads(raw)
            if purpose is not None and meta["purpose"] != purpose:
                continue
            if len(page) == limit:
                has_more = True
                break
            page.append(meta)
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": has_more,
        }


def _limit(query: Mapping[str, str], *, default: int, most: int) -> int:
    try:
        limit = int(query.get("limit", str(default)))
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise InvalidRequestError(f"Invalid value for 'limit': 1 to {most}.", param="limit")
    return limit


def read_upload(content_type: str, body: bytes, max_file_bytes: int) -> tuple[str, str, bytes]:
    """The ``(filename, purpose, content)`` of a ``multipart/form-data`` upload, as the OpenAI
    SDK sends it (a ``file`` part and a ``purpose`` field); the standard library's MIME parser
    reads it. Bad input is a 400 naming the part; a file over ``max_file_bytes`` a 413."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequestError(
            "Uploads must be multipart/form-data with a 'file' and a 'purpose'.", param="file"
        )
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    filename, purpose, content = "", None, None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if not isinstance(payload, bytes):
            continue
        if name == "purpose":
            purpose = payload.decode("utf-8", "replace").strip()
        elif name == "file":
            filename = str(part.get_filename() or "upload.jsonl")
            content = payload
    if content is None:
        raise InvalidRequestError("Missing the 'file' part of the upload.", param="file")
    if purpose != "batch":
        raise InvalidRequestError(
            f"Invalid value for 'purpose': {purpose!r}; this gateway stores 'batch' files.",
            param="purpose",
        )
    if len(content) > max_file_bytes:
        raise PayloadTooLargeError(
            f"The file is {len(content)} bytes; the most a file may hold is {max_file_bytes}.",
            param="file",
            code="file_too_large",
        )
    return filename, purpose, content
