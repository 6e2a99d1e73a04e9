"""The Files store on a real S3-compatible server (moto_server with authentication on:
every request's SigV4 signature is recomputed and checked, tests/s3_server.py) and a real
Redis: the bytes are objects of the bucket, under the prefix; big files go up in parts; a
missing bucket or bad credentials is a 502 in OpenAI's error shape that leaves nothing in
Redis; a storage outage does not fail a batch, it waits and resumes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from gateway.batch.files import FileStorageError, FileStore
from gateway.batch.s3_storage import S3Storage, S3StoreSettings
from gateway.config import ConfigError, parse_config
from gateway.store import RedisClient, StoreSettings, open_shared_redis
from portico.errors import NotFoundError

MiB = 1024 * 1024


@pytest.fixture
async def redis_client(redis_url: str, tmp_path: Path) -> AsyncIterator[RedisClient]:
    shared = await open_shared_redis(StoreSettings(url=redis_url, data_dir=tmp_path / "d"), {})
    yield shared.client
    await shared.aclose()


def storage(s3_server: Any, bucket: str, /, **overrides: Any) -> S3Storage:
    config = S3StoreSettings.model_validate({**s3_server.store_config(bucket), **overrides})
    return S3Storage(config, config.credentials({}))


def file_keys(redis_url: str) -> list[bytes]:
    return sync_redis.Redis.from_url(redis_url).keys("portico:files:*")


async def test_files_are_objects_of_the_bucket_under_the_prefix(
    s3_server: Any, redis_client: RedisClient
) -> None:
    bucket = s3_server.new_bucket()
    # a prefix that must be percent-encoded on the wire (and signed as sent)
    s3 = storage(s3_server, bucket, prefix="portico files/$x/")
    files = FileStore(redis_client, s3, 1024)
    try:
        meta = await files.create("acme", "in.jsonl", "batch", b'{"a": 1}\n')
        key = f"portico files/$x/acme/{meta['id']}"
        assert s3_server.objects(bucket) == {key: b'{"a": 1}\n'}
        assert await files.content("acme", meta["id"]) == b'{"a": 1}\n'
        for call in (files.get, files.content, files.delete):
            with pytest.raises(NotFoundError):
                await call("other", meta["id"])
        assert s3_server.objects(bucket) == {key: b'{"a": 1}\n'}  # the other's delete: nothing
        # written again under the same id (a batch's output file when finalizing repeats)
        await files.create("acme", "out.jsonl", "batch_output", b"{}\n", file_id=meta["id"])
        assert await files.content("acme", meta["id"]) == b"{}\n"
        assert (await files.delete("acme", meta["id"]))["deleted"]
        assert s3_server.objects(bucket) == {}
        with pytest.raises(NotFoundError):
            await files.content("acme", meta["id"])
    finally:
        await s3.aclose()


async def test_an_object_gone_from_the_bucket_is_a_404(
    s3_server: Any, redis_client: RedisClient
) -> None:
    bucket = s3_server.new_bucket()
    s3 = storage(s3_server, bucket)
    files = FileStore(redis_client, s3, 1024)
    try:
        meta = await files.create("acme", "in.jsonl", "batch", b"{}\n")
        s3_server.client().delete_object(Bucket=bucket, Key=f"acme/{meta['id']}")
        with pytest.raises(NotFoundError):
            await files.content("acme", meta["id"])
        assert (await files.delete("acme", meta["id"]))["deleted"]  # deleting it is no error
    finally:
        await s3.aclose()


async def test_a_file_larger_than_a_part_goes_up_in_parts(s3_server: Any) -> None:
    bucket = s3_server.new_bucket()
    s3 = storage(s3_server, bucket, multipart_part_bytes=5 * MiB)
    content = os.urandom(11 * MiB + 3)
    try:
        await s3.write("acme/file-big", content)
        assert await s3.read("acme/file-big") == content
        head = s3_server.client().head_object(Bucket=bucket, Key="acme/file-big")
        assert head["ContentLength"] == len(content)
        assert head["ETag"].strip('"').endswith("-3")  # S3's ETag of a 3-part upload
        uploads = s3_server.client().list_multipart_uploads(Bucket=bucket)
        assert uploads.get("Uploads", []) == []  # completed, none left open
    finally:
        await s3.aclose()


async def test_a_failed_multipart_upload_is_aborted(s3_server: Any) -> None:
    """Parts under S3's 5 MiB minimum (the settings refuse them; built here past the check)
    make the server refuse the completion: the upload is aborted, no part and no object stay."""
    bucket = s3_server.new_bucket()
    valid = S3StoreSettings.model_validate(s3_server.store_config(bucket))
    small_parts = valid.model_copy(update={"multipart_part_bytes": MiB})
    s3 = S3Storage(small_parts, valid.credentials({}))
    try:
        with pytest.raises(FileStorageError, match="EntityTooSmall"):
            await s3.write("acme/file-small-parts", os.urandom(2 * MiB + 1))
        uploads = s3_server.client().list_multipart_uploads(Bucket=bucket)
        assert uploads.get("Uploads", []) == []
        assert s3_server.objects(bucket) == {}
    finally:
        await s3.aclose()


@pytest.mark.parametrize("failure", ["no such bucket", "unknown key", "wrong secret"])
async def test_a_failing_storage_is_a_502_and_leaves_nothing_in_redis(
    s3_server: Any, redis_client: RedisClient, redis_url: str, failure: str
) -> None:
    bucket = s3_server.new_bucket()
    good = storage(s3_server, bucket)
    overrides: dict[str, Any] = {
        "no such bucket": {"bucket": "portico-no-such-bucket"},
        "unknown key": {"access_key_id": "AKIDUNKNOWN000000000"},
        "wrong secret": {"secret_access_key": "not-the-secret"},
    }[failure]
    bad = storage(s3_server, bucket, **overrides)
    try:
        stored = await FileStore(redis_client, good, 1024).create("acme", "a", "batch", b"1\n")
        before = sorted(file_keys(redis_url))
        files = FileStore(redis_client, bad, 1024)
        with pytest.raises(FileStorageError) as refused:
            await files.create("acme", "in.jsonl", "batch", b"{}\n")
        error = refused.value
        assert error.status_code == 502 and error.code == "file_storage_error"
        body = error.to_dict()["error"]
        assert body["type"] == "upstream_error" and "refused" in body["message"]
        assert s3_server.secret_access_key not in body["message"]
        assert sorted(file_keys(redis_url)) == before  # no metadata for bytes not stored
        # reading or deleting a stored file through the failing storage: a 502, not a 404,
        # and the file stays (its metadata and its bytes)
        for call in (files.content, files.delete):
            with pytest.raises(FileStorageError):
                await call("acme", stored["id"])
        assert sorted(file_keys(redis_url)) == before
        assert s3_server.objects(bucket) == {f"acme/{stored['id']}": b"1\n"}
    finally:
        await good.aclose()
        await bad.aclose()


async def test_an_unreachable_endpoint_is_a_502(redis_client: RedisClient) -> None:
    from tests.gateway.dataplane.harness import free_port

    config = S3StoreSettings(
        kind="s3",
        bucket="b-1",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        access_key_id="AKID",
        secret_access_key="secret",
    )
    s3 = S3Storage(config, config.credentials({}))
    try:
        with pytest.raises(FileStorageError) as refused:
            await FileStore(redis_client, s3, 1024).create("acme", "a", "batch", b"1\n")
        assert "could not be reached" in refused.value.message
    finally:
        await s3.aclose()


def test_settings_credentials_and_addressing() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    aws = S3StoreSettings(kind="s3", bucket="my-bucket", region="eu-west-1")
    assert aws.base_url() == "https://my-bucket.s3.eu-west-1.amazonaws.com"
    assert aws.credentials(env).access_key_id == "AKID"
    assert aws.credentials({**env, "AWS_SESSION_TOKEN": "tok"}).session_token == "tok"
    path = S3StoreSettings(kind="s3", bucket="b-1", endpoint_url="http://minio:9000/")
    assert path.base_url() == "http://minio:9000/b-1"
    virtual = path.model_copy(update={"addressing": "virtual"})
    assert virtual.base_url() == "http://b-1.minio:9000"
    named = S3StoreSettings(
        kind="s3", bucket="b-1", access_key_id_env="MY_ID", secret_access_key_env="MY_SECRET"
    )
    assert named.credentials({"MY_ID": "a", "MY_SECRET": "b"}).secret_access_key == "b"
    with pytest.raises(ValueError, match="MY_SECRET"):
        named.credentials({"MY_ID": "a"})
    for bad in (
        {"bucket": "B"},
        {"bucket": "b-1", "endpoint_url": "minio:9000"},
        {"bucket": "b-1", "access_key_id": "only-the-id"},
        {"bucket": "b-1", "prefix": "/abs"},
        {"bucket": "b-1", "multipart_part_bytes": MiB},
    ):
        with pytest.raises(ValueError):
            S3StoreSettings.model_validate({"kind": "s3", **bad})
    assert "s3cr3t" not in repr(S3StoreSettings(kind="s3", bucket="b-1", access_key_id="a",
                                                secret_access_key="s3cr3t"))  # fmt: skip


def test_the_gateway_config_selects_the_store() -> None:
    config = parse_config({"batches": {"store": {"kind": "s3", "bucket": "my-bucket"}}})
    assert config.batches.store is not None and config.batches.store.bucket == "my-bucket"
    assert parse_config({}).batches.store is None  # on disk, as before
    with pytest.raises(ConfigError, match="files_dir"):
        parse_config({"batches": {"files_dir": "/x", "store": {"kind": "s3", "bucket": "b-1"}}})
    with pytest.raises(ConfigError, match="batches.store.kind"):
        parse_config({"batches": {"store": {"kind": "gcs", "bucket": "b-1"}}})
