"""The Batch and Files stores on a real Redis server and a real Redis Cluster (every key of a
script or transaction shares the tenant's hash tag), with the files on disk and in a bucket of
a real S3-compatible server; the line checks, the multipart reader on the bodies httpx (the
OpenAI SDK's transport) writes, and the batch owner's principal."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from gateway.batch.batch_runner import owner_principal
from gateway.batch.batches import (
    BatchLine,
    BatchStore,
    LineError,
    Owner,
    completion_window_s,
    parse_line,
)
from gateway.batch.files import DiskStorage, FileStorage, FileStore, read_upload
from gateway.batch.s3_storage import S3Storage, S3StoreSettings
from gateway.identity.auth import AuthSettings, open_identity
from gateway.identity.records import KeyCreate, TenantCreate
from gateway.relay.engine_hop import PRIORITY_CLASS_HEADER, engine_hop_headers
from gateway.store import RedisClient, StoreSettings, open_shared_redis
from portico.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
)

CHAT = "/v1/chat/completions"


@pytest.fixture(params=["redis-server", "redis-cluster"])
async def redis_client(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[RedisClient]:
    url = request.getfixturevalue(
        "redis_url" if request.param == "redis-server" else "redis_cluster_url"
    )
    shared = await open_shared_redis(StoreSettings(url=url, data_dir=tmp_path / "data"), {})
    yield shared.client
    await shared.aclose()


def fields(window_s: int = 86400) -> dict[str, object]:
    return {
        "input_file_id": "file-x",
        "endpoint": CHAT,
        "completion_window": "24h",
        "window_s": window_s,
        "metadata": None,
    }


async def test_a_line_is_recorded_once_and_states_change_by_compare_and_set(
    redis_client: RedisClient,
) -> None:
    store = BatchStore(redis_client)
    batch = await store.create(Owner("acme", "k1", None), fields(), 3, limit=2)
    assert batch["status"] == "validating" and batch["request_counts"]["total"] == 3
    assert ("acme", batch["id"]) in await store.queued()
    assert await store.record("acme", batch["id"], 0, True, '{"a": 1}')
    assert not await store.record("acme", batch["id"], 0, False, '{"again": 1}')
    assert await store.record("acme", batch["id"], 1, False, '{"b": 1}')
    assert await store.done_lines("acme", batch["id"]) == {0, 1}
    assert (await store.view("acme", batch["id"]))["request_counts"] == {
        "total": 3,
        "completed": 1,
        "failed": 1,
    }
    out, err = await store.results("acme", batch["id"])
    assert out == {0: '{"a": 1}'} and err == {1: '{"b": 1}'}
    assert await store.transition("acme", batch["id"], ("validating",), status="in_progress")
    assert not await store.transition("acme", batch["id"], ("validating",), status="cancelled")
    assert (await store.view("acme", batch["id"]))["status"] == "in_progress"
    with pytest.raises(NotFoundError):
        await store.view("other", batch["id"])
    await store.finish("acme", batch["id"])
    assert ("acme", batch["id"]) not in await store.queued()


async def test_unfinished_batches_per_tenant_are_limited(redis_client: RedisClient) -> None:
    store = BatchStore(redis_client)
    first = await store.create(Owner("acme", None, "sub"), fields(), 1, limit=1)
    with pytest.raises(RateLimitError):
        await store.create(Owner("acme", None, "sub"), fields(), 1, limit=1)
    await store.create(Owner("other", None, "sub"), fields(), 1, limit=1)  # its own count
    await store.finish("acme", first["id"])
    second = await store.create(Owner("acme", None, "sub"), fields(), 1, limit=1)
    page = await store.page("acme", {"limit": "1"})
    assert [b["id"] for b in page["data"]] == [second["id"]] and page["has_more"]
    rest = await store.page("acme", {"after": second["id"]})
    assert [b["id"] for b in rest["data"]] == [first["id"]] and not rest["has_more"]


async def test_one_runner_holds_a_batch_lease(redis_client: RedisClient) -> None:
    store = BatchStore(redis_client)
    assert await store.take_lease("acme", "batch_1", "a", 10)
    assert not await store.take_lease("acme", "batch_1", "b", 10)
    assert await store.take_lease("acme", "batch_1", "a", 10)  # renewed
    await store.drop_lease("acme", "batch_1", "b")  # not b's to drop
    assert not await store.take_lease("acme", "batch_1", "b", 10)
    await store.drop_lease("acme", "batch_1", "a")
    assert await store.take_lease("acme", "batch_1", "b", 10)


@pytest.fixture(params=["disk", "s3"])
async def file_storage(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[FileStorage, Callable[[str], bool]]]:
    """The storage (on disk, or in a bucket of a real S3-compatible server) and a check
    whether it holds a key."""
    if request.param == "disk":
        disk = DiskStorage(tmp_path / "files")
        yield disk, lambda key: disk.path(key).exists()
        return
    server = request.getfixturevalue("s3_server")
    bucket = server.new_bucket()
    settings = S3StoreSettings.model_validate(server.store_config(bucket))
    s3 = S3Storage(settings, settings.credentials({}))
    yield s3, lambda key: key in server.objects(bucket)
    await s3.aclose()


async def test_files_are_per_tenant(
    redis_client: RedisClient, file_storage: tuple[FileStorage, Callable[[str], bool]]
) -> None:
    storage, holds = file_storage
    files = FileStore(redis_client, storage, 1024)
    meta = await files.create("acme", "in.jsonl", "batch", b"{}\n")
    assert await files.content("acme", meta["id"]) == b"{}\n"
    assert holds(f"acme/{meta['id']}")
    for call in (files.get, files.content, files.delete):
        with pytest.raises(NotFoundError):
            await call("other", meta["id"])
    page = await files.list_page("acme", {"purpose": "batch"})
    assert [f["id"] for f in page["data"]] == [meta["id"]]
    assert (await files.list_page("acme", {"purpose": "batch_output"}))["data"] == []
    assert (await files.delete("acme", meta["id"]))["deleted"]
    assert not holds(f"acme/{meta['id']}")


def test_lines_are_checked_one_by_one() -> None:
    good = {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": "m"}}
    assert isinstance(parse_line(0, json.dumps(good).encode(), CHAT, "m"), BatchLine)
    cases = {
        b"{oops": "invalid_json_line",
        b"[1]": "invalid_json_line",
        json.dumps({**good, "custom_id": ""}).encode(): "missing_custom_id",
        json.dumps({**good, "method": "GET"}).encode(): "invalid_method",
        json.dumps({**good, "url": "/v1/embeddings"}).encode(): "invalid_url",
        json.dumps({**good, "body": []}).encode(): "invalid_body",
        json.dumps({**good, "body": {"model": "n"}}).encode(): "model_mismatch",
        json.dumps({**good, "body": {"model": "m", "stream": True}}).encode(): "invalid_body",
    }
    for raw, code in cases.items():
        line = parse_line(3, raw, CHAT, "m")
        assert isinstance(line, LineError) and line.code == code and line.index == 3, raw


def test_completion_windows() -> None:
    assert completion_window_s("24h") == 86400 and completion_window_s("90s") == 90
    for bad in ("25h", "0s", "1d", 24, None, "h"):
        with pytest.raises(InvalidRequestError):
            completion_window_s(bad)


def test_multipart_upload_as_httpx_writes_it() -> None:
    request = httpx.Request(
        "POST",
        "http://gw/v1/files",
        files={"file": ("in.jsonl", b"{}\n{}\n")},
        data={"purpose": "batch"},
    )
    body, content_type = request.read(), request.headers["content-type"]
    assert read_upload(content_type, body, 1024) == ("in.jsonl", "batch", b"{}\n{}\n")
    with pytest.raises(PayloadTooLargeError):
        read_upload(content_type, body, 4)
    other = httpx.Request("POST", "http://gw", files={"file": ("x", b"1")}, data={"purpose": "x"})
    with pytest.raises(InvalidRequestError):
        read_upload(other.headers["content-type"], other.read(), 1024)
    with pytest.raises(InvalidRequestError):
        read_upload("application/json", b"{}", 1024)


async def test_the_owner_runs_at_the_batch_class_until_its_key_is_revoked(
    redis_url: str, tmp_path: Path
) -> None:
    settings = StoreSettings(url=redis_url, data_dir=tmp_path / "data")
    shared = await open_shared_redis(settings, {})
    identity = open_identity(shared.client, settings, AuthSettings(), {})
    try:
        tenants = identity.store
        await tenants.create_tenant(TenantCreate(id="acme", name="acme", plan="standard"))
        key, _ = await tenants.create_key("acme", KeyCreate())
        owner = {"key_id": key.id, "subject": None}
        principal = await owner_principal(tenants, "acme", owner)
        assert principal.tenant_id == "acme" and principal.key_id == key.id
        assert engine_hop_headers(principal)[PRIORITY_CLASS_HEADER] == "batch"
        await tenants.revoke_key("acme", key.id)
        with pytest.raises(AuthenticationError):
            await owner_principal(tenants, "acme", owner)
    finally:
        await identity.aclose()
        await shared.aclose()
