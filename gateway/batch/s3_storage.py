"""File bytes in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, R2, ...): the
:class:`~gateway.batch.files.FileStorage` that ``batches.store: {kind: s3, ...}`` selects.

Five requests, each signed with AWS Signature Version 4 (batch/sigv4.py) and sent with
one httpx client: PUT object, GET object, DELETE object, and for a file larger than
``multipart_part_bytes`` a multipart upload (create, one PUT per part, complete; aborted when
any step fails, so no parts are left behind). An object's key is ``<prefix><tenant>/<file
id>``. A missing object is ``FileNotFoundError``; every other refusal (no such bucket, bad
credentials, access denied) and an unreachable endpoint is a
:class:`~gateway.batch.files.FileStorageError` whose details (S3's error code and
message, the bucket, the key) go to the log, not to the tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Literal
from xml.sax.saxutils import escape

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.batch.files import FileStorageError
from gateway.batch.sigv4 import Credentials, sign, uri_encode

log = logging.getLogger("portico.gateway.files")

MiB = 1024 * 1024
HASH_IN_THREAD_BYTES = MiB  # larger payloads are hashed off the event loop


class S3StoreSettings(BaseModel):
    """``batches.store``: an S3-compatible bucket for uploaded files and batch results."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["s3"]
    bucket: str = Field(min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]+[a-z0-9]$")
    # None: AWS's regional endpoint, https://s3.<region>.amazonaws.com
    endpoint_url: str | None = None
    region: str = Field(default="us-east-1", min_length=1)
    prefix: str = ""  # prepended to every key, e.g. "portico/files/"
    # path: <endpoint>/<bucket>/<key>; virtual: <bucket>.<endpoint host>/<key>;
    # None: virtual for AWS (no endpoint_url), path for any other endpoint
    addressing: Literal["path", "virtual"] | None = None
    # the key pair in the config, or (each unset) read from these environment variables
    access_key_id: str | None = None
    secret_access_key: str | None = Field(default=None, repr=False)
    access_key_id_env: str = "AWS_ACCESS_KEY_ID"
    secret_access_key_env: str = "AWS_SECRET_ACCESS_KEY"
    session_token_env: str = "AWS_SESSION_TOKEN"  # temporary credentials' token, if set
    timeout_s: float = Field(default=60.0, gt=0, le=3600)
    connect_timeout_s: float = Field(default=5.0, gt=0, le=600)
    # a file larger than this goes up in parts of this size (S3: 5 MiB to 5 GiB a part)
    multipart_part_bytes: int = Field(default=64 * MiB, ge=5 * MiB, le=5 * 1024 * MiB)

    @model_validator(mode="after")
    def _consistent(self) -> S3StoreSettings:
        if self.endpoint_url is not None and not self.endpoint_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError("endpoint_url must start with http:// or https://")
        if self.prefix.startswith("/"):
            raise ValueError("prefix must not start with '/'")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("access_key_id and secret_access_key: set both or neither")
        return self

    def credentials(self, env: Mapping[str, str]) -> Credentials:
        """The configured key pair, or the one in the environment; ValueError naming the
        variable (never a value) when it is missing."""
        if self.access_key_id is not None and self.secret_access_key is not None:
            return Credentials(self.access_key_id, self.secret_access_key)
        found = {}
        for name in (self.access_key_id_env, self.secret_access_key_env):
            found[name] = env.get(name, "").strip()
            if not found[name]:
                raise ValueError(
                    f"batches.store: the environment variable {name} is not set "
                    "(or set access_key_id and secret_access_key)"
                )
        token = env.get(self.session_token_env, "").strip() or None
        return Credentials(found[self.access_key_id_env], found[self.secret_access_key_env], token)

    def base_url(self) -> str:
        """The bucket's URL, without a trailing slash."""
        endpoint = (self.endpoint_url or f"https://s3.{self.region}.amazonaws.com").rstrip("/")
        addressing = self.addressing or ("virtual" if self.endpoint_url is None else "path")
        if addressing == "path":
            return f"{endpoint}/{self.bucket}"
        url = httpx.URL(endpoint)
        return f"{url.scheme}://{self.bucket}.{url.netloc.decode('ascii')}{url.path.rstrip('/')}"


class S3Storage:
    """File bytes as objects of one bucket. Safe to share between coroutines (one httpx
    client; each request is signed on its own)."""

    def __init__(
        self,
        settings: S3StoreSettings,
        credentials: Credentials,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.settings = settings
        self.credentials = credentials
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s),
            follow_redirects=False,
        )
        self._base = settings.base_url()

    async def write(self, key: str, content: bytes) -> None:
        if len(content) > self.settings.multipart_part_bytes:
            await self._write_parts(key, content)
            return
        response = await self._send("PUT", key, content=content)
        if response.status_code != 200:
            raise self._refused(response, "store", key)

    async def read(self, key: str) -> bytes:
        response = await self._send("GET", key)
        if response.status_code == 404 and _error_code(response) == "NoSuchKey":
            raise FileNotFoundError(key)
        if response.status_code != 200:
            raise self._refused(response, "read", key)
        return response.content

    async def remove(self, key: str) -> None:
        response = await self._send("DELETE", key)
        missing = response.status_code == 404 and _error_code(response) == "NoSuchKey"
        if response.status_code not in (200, 204) and not missing:
            raise self._refused(response, "delete", key)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _write_parts(self, key: str, content: bytes) -> None:
        """A multipart upload: every part but the last ``multipart_part_bytes`` long; aborted
        (its parts dropped) when a step fails or the write is cancelled."""
        started = await self._send("POST", key, query="uploads=")
        upload_id = _xml_text(started.content, "UploadId") if started.status_code == 200 else None
        if upload_id is None:
            raise self._refused(started, "store", key)
        upload = f"uploadId={uri_encode(upload_id, keep_slash=False)}"
        try:
            parts = []
            size = self.settings.multipart_part_bytes
            for number, start in enumerate(range(0, len(content), size), start=1):
                part = await self._send(
                    "PUT",
                    key,
                    query=f"partNumber={number}&{upload}",
                    content=content[start : start + size],
                )
                if part.status_code != 200 or "etag" not in part.headers:
                    raise self._refused(part, "store", key)
                parts.append(
                    f"<Part><PartNumber>{number}</PartNumber>"
                    f"<ETag>{escape(part.headers['etag'])}</ETag></Part>"
                )
            document = f"<CompleteMultipartUpload>{''.join(parts)}</CompleteMultipartUpload>"
            done = await self._send("POST", key, query=upload, content=document.encode())
            # S3 may answer 200 and still fail the completion, with an <Error> body
            if done.status_code != 200 or _error_code(done) is not None:
                raise self._refused(done, "store", key)
        except BaseException:
            with contextlib.suppress(Exception):
                await self._send("DELETE", key, query=upload)
            raise

    async def _send(
        self, method: str, key: str, *, query: str = "", content: bytes = b""
    ) -> httpx.Response:
        path = uri_encode(self.settings.prefix + key, keep_slash=True)
        url = httpx.URL(f"{self._base}/{path}" + (f"?{query}" if query else ""))
        if len(content) > HASH_IN_THREAD_BYTES:
            payload_sha256 = (await asyncio.to_thread(hashlib.sha256, content)).hexdigest()
        else:
            payload_sha256 = hashlib.sha256(content).hexdigest()
        headers = sign(method, url, {}, payload_sha256, self.credentials, self.settings.region)
        try:
            return await self.client.request(method, url, content=content, headers=headers)
        except httpx.HTTPError as exc:
            log.warning(
                "file store: %s %s in bucket %s failed: %r",
                method,
                key,
                self.settings.bucket,
                exc,
            )
            raise FileStorageError("The file storage could not be reached.") from exc

    def _refused(self, response: httpx.Response, action: str, key: str) -> FileStorageError:
        code = _error_code(response) or f"HTTP {response.status_code}"
        log.warning(
            "file store: %s %s in bucket %s refused: %d %s %s",
            response.request.method,
            key,
            self.settings.bucket,
            response.status_code,
            code,
            _xml_text(response.content, "Message") or "",
        )
        return FileStorageError(f"The file storage refused to {action} the file ({code}).")


def _xml_text(document: bytes, tag: str) -> str | None:
    """The text of the first element named ``tag`` (any namespace), or None."""
    try:
        root = ET.fromstring(document)
    except ET.ParseError:
        return None
    for element in root.iter():
        if element.tag == tag or element.tag.endswith("}" + tag):
            return element.text or ""
    return None


def _error_code(response: httpx.Response) -> str | None:
    """S3's error code (``NoSuchKey``, ``NoSuchBucket``, ``InvalidAccessKeyId``, ...)."""
    if not response.content.lstrip().startswith(b"<"):
        return None
    try:
        root = ET.fromstring(response.content)
    except ET.ParseError:
        return None
    if root.tag != "Error":
        return None
    code = root.findtext("Code")
    return code or None
