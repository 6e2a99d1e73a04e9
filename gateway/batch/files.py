"""The OpenAI Files API's store, per tenant: file bytes in a :class:`FileStorage`, metadata in
Redis.

A file's bytes are one object under the key ``<tenant>/<file id>`` in the configured storage:
on disk under ``files_dir`` (the gateway's data dir by default, written to a temporary name
and renamed, so a reader never sees half a file; :class:`DiskStorage`), or in an
S3-compatible bucket (``batches.store``, batch/s3_storage.py). Its metadata (the file
object OpenAI returns) is one Redis string ``portico:files:{tenant}:<id>`` and the tenant's
listing one sorted set ``portico:files:{tenant}`` (score: creation time), the tenant as the hash
tag as everywhere in the store. Every read goes through the tenant: another tenant's file id is
a 404, exactly as an id that never existed. Gateway replicas that share Redis share files when
they share the storage: one bucket, or one ``files_dir`` (a shared volume).
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
from typing import Any, Protocol

from gateway.store import RedisClient
from portico.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError, UpstreamError

_FILE_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,64}$")


def file_key(tenant_id: str, file_id: str) -> str:
    return f"portico:files:{{{tenant_id}}}:{file_id}"


def files_index_key(tenant_id: str) -> str:
    return f"portico:files:{{{tenant_id}}}"


def _not_found(file_id: str) -> NotFoundError:
    return NotFoundError(f"No such File object: {file_id}", param="id", code="file_not_found")


class FileStorageError(UpstreamError):
    """The storage holding file bytes could not be reached or refused a request (a missing
    bucket, bad credentials): a 502 for the client, the details in the gateway's log."""

    default_code = "file_storage_error"


class FileStorage(Protocol):
    """Where file bytes live, by key (``<tenant>/<file id>``). A write replaces the whole
    object at once (a reader sees the old bytes or the new, never part); ``read`` raises
    ``FileNotFoundError`` for a key that holds nothing; ``remove`` of such a key is no error.
    A remote storage that refuses a request or cannot be reached raises
    :class:`FileStorageError`."""

    async def write(self, key: str, content: bytes) -> None: ...

    async def read(self, key: str) -> bytes: ...

    async def remove(self, key: str) -> None: ...

    async def aclose(self) -> None: ...


class DiskStorage:
    """File bytes under ``root``: ``root/<tenant>/<file id>``, written to a temporary name,
    synced and renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, key: str) -> Path:
        return self.root / key

    async def write(self, key: str, content: bytes) -> None:
        await asyncio.to_thread(self._write, self.path(key), content)

    @staticmethod
    def _write(path: Path, content: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        with open(partial, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)

    async def read(self, key: str) -> bytes:
        return await asyncio.to_thread(self.path(key).read_bytes)

    async def remove(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    async def aclose(self) -> None:
        return None


class FileStore:
    """Create, read, list and delete a tenant's files. Safe to share between coroutines: every
    write replaces a whole object in the storage, plus single-key Redis commands. The bytes are
    written before the metadata and removed before it, so a failing storage leaves nothing in
    Redis that points at bytes it does not hold."""

    def __init__(self, redis: RedisClient, storage: FileStorage, max_file_bytes: int) -> None:
        self.redis = redis
        self.storage = storage
        self.max_file_bytes = max_file_bytes

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
        await self.storage.write(f"{tenant_id}/{file_id}", content)
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
            return await self.storage.read(f"{tenant_id}/{file_id}")
        except FileNotFoundError:
            raise _not_found(file_id) from None

    async def delete(self, tenant_id: str, file_id: str) -> dict[str, Any]:
        await self.get(tenant_id, file_id)
        await self.storage.remove(f"{tenant_id}/{file_id}")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(file_key(tenant_id, file_id))
            pipe.zrem(files_index_key(tenant_id), file_id)
            await pipe.execute()
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
