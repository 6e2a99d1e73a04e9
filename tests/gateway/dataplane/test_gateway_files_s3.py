"""The Files and Batch APIs with the S3-compatible store, end to end: real ``portico serve``
processes (fake engines), the real ``openai`` client, real Redis and a real S3-compatible
server (moto_server, every request's signature checked: tests/s3_server.py).

Two gateway replicas share one Redis and one bucket: ``api`` serves the APIs and runs no
batch, ``runner`` serves them and runs the batches. A file uploaded to one is read, listed and
deleted through the other; a batch created on one is run by the other, its output file an
object of the bucket. Another tenant gets 404 for every id. A store that refuses the gateway
(a wrong secret, a missing bucket) answers a 502 in OpenAI's error shape and leaves nothing in
Redis; a runner the store refuses to read a batch's input file keeps the batch (it does not
fail) and finishes it once the store lets it read again.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.gateway.dataplane.harness import GatewayProcess, fake_engine_command, wait_until

pytestmark = pytest.mark.slow  # four gateway processes, as the other batch end-to-end tests

CHAT = "/v1/chat/completions"


def gateway_config(redis_url: str, store: dict[str, Any], run: bool = True) -> dict[str, Any]:
    return {
        "redis": {"url": redis_url},
        "engines": [{"name": "fake", "command": fake_engine_command()}],
        "batches": {"store": store, "run": run, "scan_interval_s": 0.5, "lease_s": 2},
    }


@pytest.fixture(scope="module")
def shared(module_tmp: Path, redis_server: Any, s3_server: Any) -> Iterator[dict[str, Any]]:
    """Two replicas on one Redis and one bucket, each with its own IAM user (so one can be
    denied an action without touching the other)."""
    bucket = s3_server.new_bucket()
    secret = module_tmp / "key_hash_secret"  # replicas hash tenants' keys alike
    secret.write_text("0123456789abcdef0123456789abcdef")
    users = {}
    gateways = {}
    try:
        for name, run in (("api", False), ("runner", True)):
            user, key_id, key_secret = s3_server.new_user()
            users[name] = user
            store = s3_server.store_config(
                bucket, access_key_id=key_id, secret_access_key=key_secret, prefix="files/"
            )
            config = gateway_config(redis_server.url, store, run)
            config["auth"] = {"key_hash_secret_file": str(secret)}
            gw = GatewayProcess(module_tmp / name, config, {})
            gateways[name] = gw
            gw.start(timeout=120)
        yield {"bucket": bucket, "users": users, **gateways}
    finally:
        for gw in gateways.values():
            assert gw.terminate() == 0, gw.log()


def client_of(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=30)


def chat_line(custom_id: str) -> dict[str, Any]:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch").id


def wait_done(client: openai.OpenAI, batch_id: str) -> Any:
    final = ("completed", "failed", "expired", "cancelled")
    assert wait_until(
        lambda: client.batches.retrieve(batch_id).status in final, timeout=120, interval=0.3
    )
    return client.batches.retrieve(batch_id)


def test_replicas_share_files_and_batches_through_the_bucket(
    shared: dict[str, Any], s3_server: Any
) -> None:
    api, runner, bucket = shared["api"], shared["runner"], shared["bucket"]
    tenant, key = api.create_tenant("standard")
    on_api, on_runner = client_of(api, key), client_of(runner, key)
    file_id = upload(on_api, [chat_line("a"), chat_line("b")])
    assert f"files/{tenant}/{file_id}" in s3_server.objects(bucket)
    # uploaded on one replica, read on the other
    assert on_runner.files.retrieve(file_id).purpose == "batch"
    assert json.loads(on_runner.files.content(file_id).text.splitlines()[1])["custom_id"] == "b"
    assert [f.id for f in on_runner.files.list()] == [file_id]
    # created on the API replica, run by the runner
    batch = on_api.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    done = wait_done(on_api, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2, done
    assert done.output_file_id is not None and done.error_file_id is None
    stored = s3_server.objects(bucket)[f"files/{tenant}/{done.output_file_id}"]
    downloaded = on_api.files.content(done.output_file_id).content
    assert downloaded == stored
    output = [json.loads(line) for line in downloaded.splitlines()]
    assert [o["custom_id"] for o in output] == ["a", "b"]
    assert all(o["response"]["status_code"] == 200 for o in output)
    # deleted on one replica: gone from the bucket and from the other
    assert on_runner.files.delete(file_id).deleted
    assert f"files/{tenant}/{file_id}" not in s3_server.objects(bucket)
    with pytest.raises(openai.NotFoundError):
        on_api.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        on_api.files.content(file_id)


def test_another_tenant_gets_404_for_every_id(shared: dict[str, Any], s3_server: Any) -> None:
    api = shared["api"]
    _, owner_key = api.create_tenant("standard")
    _, other_key = api.create_tenant("standard")
    owner, other = client_of(api, owner_key), client_of(api, other_key)
    file_id = upload(owner, [chat_line("a")])
    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: other.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(other.files.list()) == []
    # untouched by the other's delete
    assert json.loads(owner.files.content(file_id).text)["custom_id"] == "a"
    assert any(key.endswith(file_id) for key in s3_server.objects(shared["bucket"]))


def test_a_batch_waits_while_the_store_refuses_its_input_and_then_finishes(
    shared: dict[str, Any], s3_server: Any
) -> None:
    api, runner = shared["api"], shared["runner"]
    _, key = api.create_tenant("standard")
    client = client_of(api, key)
    file_id = upload(client, [chat_line("a")])
    s3_server.deny(shared["users"]["runner"], ["s3:GetObject"])
    try:
        batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        # the runner tries, is refused, and tries again on later scans; the batch stays
        refused = "refused to read the file (AccessDenied). It resumes on the next scan."
        assert wait_until(lambda: runner.log().count(refused) >= 2, timeout=60), runner.log()
        assert client.batches.retrieve(batch.id).status in ("validating", "in_progress")
    finally:
        s3_server.deny(shared["users"]["runner"], None)
    done = wait_done(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 1, done


@pytest.mark.parametrize("failure", ["wrong secret", "no such bucket"])
def test_a_refusing_store_is_a_502_and_leaves_nothing_in_redis(
    tmp_path: Path, redis_server: Any, s3_server: Any, failure: str
) -> None:
    bucket = s3_server.new_bucket()
    store = s3_server.store_config(bucket)
    if failure == "wrong secret":
        store["secret_access_key"] = "not-the-secret"
    else:
        store["bucket"] = "portico-no-such-bucket"
    gw = GatewayProcess(tmp_path, gateway_config(redis_server.url, store), {})
    gw.start(timeout=120)
    try:
        tenant, key = gw.create_tenant("standard")
        r = httpx.post(
            gw.base_url + "/v1/files",
            headers={"authorization": f"Bearer {key}"},
            files={"file": ("in.jsonl", b"{}\n")},
            data={"purpose": "batch"},
            timeout=30,
        )
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["code"] == "file_storage_error" and error["type"] == "upstream_error"
        assert "refused" in error["message"] and s3_server.secret_access_key not in r.text
        expected = "SignatureDoesNotMatch" if failure == "wrong secret" else "NoSuchBucket"
        assert expected in error["message"]
        with pytest.raises(openai.APIStatusError) as sdk:
            client_of(gw, key).files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
        assert sdk.value.status_code == 502
        r = redis.Redis.from_url(redis_server.url)
        assert r.keys(f"portico:files:{{{tenant}}}*") == []
        r.close()
        assert s3_server.objects(bucket) == {}
    finally:
        assert gw.terminate() == 0, gw.log()
