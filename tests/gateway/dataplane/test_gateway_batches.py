"""The Files and Batch APIs end to end: the real ``openai`` client holding a tenant's key,
a real ``portico serve`` supervising a real tiny engine, real Redis.

Proves: upload, create, poll and download through the SDK, with the output and error files in
OpenAI's line format; bad lines (not JSON, another endpoint, another model, a bad parameter, a
repeated custom_id) go to the error file with their own error and the batch still completes;
every line is charged to the tenant like the same request sent interactively (usage recorded,
no concurrency slot left behind); another tenant gets 404 for every id; the limits (file size,
lines per batch, unfinished batches per tenant); cancel; the completion window (expired).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.dataplane.harness import (
    GatewayProcess,
    live_slots,
    tiny_engine,
    usage_requests,
    wait_until,
)

pytestmark = pytest.mark.slow

ROUTING = {"tiers": [{"name": "small", "model": "tiny"}]}
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_server: Any, tiny_llama_dir: Path) -> Iterator[GatewayProcess]:
    config = {
        "redis": {"url": redis_server.url},
        "engines": [tiny_engine(tiny_llama_dir, "tiny")],
        "batches": {
            "max_file_bytes": 64 * 1024,
            "max_lines_per_batch": 20,
            "max_batches_per_tenant": 1,
            "scan_interval_s": 0.5,
        },
    }
    gw = GatewayProcess(module_tmp, config, ROUTING)
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def client_for(gateway: GatewayProcess, **fields: Any) -> tuple[str, openai.OpenAI]:
    tenant, key = gateway.create_tenant("standard", **fields)
    return tenant, openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=60
    )


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0.0,
        **body,
    }
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def upload(client: openai.OpenAI, lines: list[Any]) -> str:
    text = "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines)
    created = client.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
    return created.id


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> Any:
    final = ("completed", "failed", "expired", "cancelled")
    assert wait_until(
        lambda: client.batches.retrieve(batch_id).status in final, timeout=timeout, interval=0.5
    ), client.batches.retrieve(batch_id)
    return client.batches.retrieve(batch_id)


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(ln) for ln in client.files.content(file_id).text.splitlines()]


def test_sdk_batch_end_to_end_with_bad_lines_in_the_error_file(
    gateway: GatewayProcess, redis_server: Any
) -> None:
    tenant, client = client_for(gateway)
    lines: list[Any] = [
        chat_line("a", "Say hello."),
        "{not json",
        {**chat_line("wrong-url", "x"), "url": "/v1/embeddings"},
        chat_line("other-model", "x", model="smollm2"),
        chat_line("bad-param", "x", temperature="hot"),
        chat_line("b", "Name a color."),
        chat_line("a", "Repeated id."),
        chat_line("c", "Count to three."),
    ]
    file_id = upload(client, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(
        input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"job": "e2e"}
    )
    assert batch.status == "validating" and batch.request_counts.total == 8
    done = wait_done(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.completed == 3 and done.request_counts.failed == 5
    assert done.metadata == {"job": "e2e"} and done.completed_at is not None
    output = read_jsonl(client, done.output_file_id)
    assert [o["custom_id"] for o in output] == ["a", "b", "c"]
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "chat.completion"
        assert o["response"]["body"]["usage"]["completion_tokens"] >= 1
        assert o["id"].startswith("batch_req_") and o["response"]["request_id"]
    errors = {
        (e["custom_id"], (e["error"] or {}).get("code")): e
        for e in read_jsonl(client, done.error_file_id)
    }
    assert set(errors) == {
        (None, "invalid_json_line"),
        ("wrong-url", "invalid_url"),
        ("other-model", "model_mismatch"),
        ("bad-param", None),
        ("a", "duplicate_custom_id"),
    }
    bad = errors[("bad-param", None)]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    # charged like interactive requests: the three answered lines, no slot left held
    assert wait_until(lambda: usage_requests(redis_server.url, tenant) == 3, timeout=30)
    assert live_slots(redis_server.url, tenant) == 0
    listed = client.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]
    assert {f.id for f in client.files.list()} == {file_id, done.output_file_id, done.error_file_id}
    deleted = client.files.delete(file_id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def test_embeddings_and_completions_batches(gateway: GatewayProcess) -> None:
    _, client = client_for(gateway)
    completion = {"model": "tiny", "prompt": "Once", "max_tokens": 3}
    for endpoint, body, obj in (
        ("/v1/embeddings", {"model": "tiny", "input": "a short text"}, "list"),
        ("/v1/completions", completion, "text_completion"),
    ):
        line = {"custom_id": "x", "method": "POST", "url": endpoint, "body": body}
        file_id = upload(client, [line])
        batch = client.batches.create(
            input_file_id=file_id,
            endpoint=endpoint,  # type: ignore[arg-type]
            completion_window="24h",
        )
        done = wait_done(client, batch.id)
        assert done.status == "completed" and done.error_file_id is None, done
        (answer,) = read_jsonl(client, done.output_file_id)
        assert answer["response"]["body"]["object"] == obj


def test_another_tenant_gets_404_for_every_id(gateway: GatewayProcess) -> None:
    _, owner = client_for(gateway)
    _, other = client_for(gateway)
    file_id = upload(owner, [chat_line("a", "hi")])
    batch = owner.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(other.files.list()) == [] and list(other.batches.list()) == []
    assert wait_done(owner, batch.id).status == "completed"
    assert owner.files.retrieve(file_id).id == file_id  # untouched by the other's delete


def test_limits_and_cancel(gateway: GatewayProcess) -> None:
    # one request a minute: the first line runs, the next waits a minute for the limit, so
    # the batch is certainly unfinished while the second is created and then cancelled
    _, client = client_for(gateway, overrides={"requests_per_minute": 1})
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 70_000)), purpose="batch")
    assert too_big.value.status_code == 413
    many = upload(client, [chat_line(str(i), "hi") for i in range(21)])
    with pytest.raises(openai.BadRequestError) as too_many:
        client.batches.create(input_file_id=many, endpoint=CHAT, completion_window="24h")
    assert too_many.value.code == "invalid_line_count"
    with pytest.raises(openai.BadRequestError) as bad_endpoint:
        client.batches.create(
            input_file_id=many,
            endpoint="/v1/moderations",  # type: ignore[arg-type]
            completion_window="24h",
        )
    assert bad_endpoint.value.param == "endpoint"  # type: ignore[attr-defined]
    file_id = upload(client, [chat_line(str(i), "hi") for i in range(3)])
    first = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.RateLimitError) as limited:
        client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    assert limited.value.code == "batch_limit_reached"
    assert client.batches.cancel(first.id).status in ("cancelling", "cancelled")
    done = wait_done(client, first.id)
    assert done.status == "cancelled" and done.cancelled_at is not None, done
    assert done.request_counts.completed + done.request_counts.failed < 3
    # finished batches do not count: the tenant may create one again
    second = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    client.batches.cancel(second.id)
    assert wait_done(client, second.id).status == "cancelled"


def test_completion_window_expires_the_lines_not_run(gateway: GatewayProcess) -> None:
    _, client = client_for(gateway, overrides={"requests_per_minute": 1})
    file_id = upload(client, [chat_line(str(i), "hi") for i in range(3)])
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint=CHAT,
        completion_window="2s",  # type: ignore[arg-type]
    )
    done = wait_done(client, batch.id)
    assert done.status == "expired" and done.expired_at is not None, done
    errors = read_jsonl(client, done.error_file_id)
    expired = [e["custom_id"] for e in errors if e["error"]["code"] == "batch_expired"]
    assert {"1", "2"} <= set(expired)  # the limit lets one line a minute: two never ran
    assert done.request_counts.completed + done.request_counts.failed == 3


def test_a_spent_token_budget_sends_lines_to_the_error_file(gateway: GatewayProcess) -> None:
    _, client = client_for(gateway, overrides={"monthly_token_budget": 5})
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)  # type: ignore[arg-type]

    def spent() -> bool:  # the first answer's usage is settled after it is sent
        try:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)  # type: ignore[arg-type]
        except openai.RateLimitError as exc:
            return exc.code == "insufficient_quota"
        return False

    assert wait_until(spent, timeout=30)
    file_id = upload(client, [chat_line(str(i), "hi") for i in range(2)])
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    done = wait_done(client, batch.id)
    assert done.status == "completed" and done.output_file_id is None, done
    errors = read_jsonl(client, done.error_file_id)
    assert [e["response"]["status_code"] for e in errors] == [429, 429]
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"insufficient_quota"}
