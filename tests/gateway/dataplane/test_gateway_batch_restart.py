"""A batch survives its gateway: a real ``portico serve`` is stopped mid-batch and another one,
on the same Redis and data dir, resumes it.

Stopped with SIGTERM (a drain): the lines in flight finish and are recorded, the next gateway
runs only the lines without a result; every line is answered once in the output file and the
tenant is charged for exactly one request per line (no line run twice, none lost). Killed with
SIGKILL: the lines in flight lose their answers and run again once the dead runner's lease
expires; the output file still holds every line exactly once. The SIGTERM case runs with the
files on disk and in an S3-compatible bucket.

The engine is the fast fake upstream (``fake_chunk_delay_ms`` makes each line take a while),
so the batch is certainly mid-way when the first gateway stops.
"""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import redis

from tests.gateway.dataplane.harness import (
    GatewayProcess,
    fake_engine_command,
    usage_requests,
    wait_until,
)

pytestmark = pytest.mark.slow

NUM_LINES = 40
CHAT = "/v1/chat/completions"


def gateway_config(redis_url: str, store: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "redis": {"url": redis_url},
        "engines": [{"name": "fake", "command": fake_engine_command()}],
        "batches": {"max_concurrency": 2, "scan_interval_s": 0.5, "lease_s": 3, "store": store},
    }


def start_batch(gw: GatewayProcess) -> tuple[str, openai.OpenAI, str]:
    tenant, key = gw.create_tenant("standard", overrides={"max_concurrency": 64})
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0)
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "fake_chunk_delay_ms": 100,
    }
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": CHAT, "body": body}
        for i in range(NUM_LINES)
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    return tenant, client, batch.id


def answered(client: openai.OpenAI, batch_id: str) -> int:
    return client.batches.retrieve(batch_id).request_counts.completed  # type: ignore[union-attr]


def resume_and_check(
    workdir: Path,
    redis_url: str,
    key_client: openai.OpenAI,
    batch_id: str,
    store: dict[str, Any] | None = None,
) -> GatewayProcess:
    second = GatewayProcess(workdir, gateway_config(redis_url, store), {})
    second.start(timeout=300)
    client = key_client.with_options(base_url=second.base_url + "/v1")
    assert wait_until(
        lambda: client.batches.retrieve(batch_id).status == "completed", timeout=300, interval=0.5
    ), second.log()
    done = client.batches.retrieve(batch_id)
    assert done.request_counts.completed == NUM_LINES and done.error_file_id is None  # type: ignore[union-attr]
    assert done.output_file_id is not None
    output = [json.loads(ln) for ln in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == [f"line-{i}" for i in range(NUM_LINES)]
    assert all(o["response"]["status_code"] == 200 for o in output)
    return second


@pytest.mark.parametrize("storage", ["disk", "s3"])
def test_sigterm_mid_batch_then_a_new_gateway_runs_each_line_once(
    tmp_path: Path, redis_server: Any, storage: str, request: pytest.FixtureRequest
) -> None:
    store = None
    if storage == "s3":  # the files in a bucket of a real S3-compatible server
        s3_server = request.getfixturevalue("s3_server")
        store = s3_server.store_config(s3_server.new_bucket())
    first = GatewayProcess(tmp_path, gateway_config(redis_server.url, store), {})
    first.start(timeout=300)
    try:
        tenant, client, batch_id = start_batch(first)
        assert wait_until(lambda: answered(client, batch_id) >= 4, timeout=120), first.log()
    finally:
        assert first.terminate() == 0, first.log()
    # the drain recorded the lines in flight; the rest waits in Redis
    r = redis.Redis.from_url(redis_server.url)
    done_before = r.hlen(f"portico:batch_out:{{{tenant}}}:{batch_id}")
    r.close()
    assert 4 <= done_before < NUM_LINES
    second = resume_and_check(tmp_path, redis_server.url, client, batch_id, store)
    assert second.terminate() == 0, second.log()
    # usage is flushed when each gateway stops: one request per line, none twice
    assert usage_requests(redis_server.url, tenant) == NUM_LINES


def test_sigkill_mid_batch_loses_no_line(tmp_path: Path, redis_server: Any) -> None:
    first = GatewayProcess(tmp_path, gateway_config(redis_server.url), {})
    first.start(timeout=300)
    try:
        _, client, batch_id = start_batch(first)
        assert wait_until(lambda: answered(client, batch_id) >= 4, timeout=120), first.log()
    finally:
        assert first.proc is not None
        engines = psutil.Process(first.proc.pid).children(recursive=True)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
        for engine in engines:  # children it can no longer stop
            engine.kill()
    second = resume_and_check(tmp_path, redis_server.url, client, batch_id)
    assert second.terminate() == 0, second.log()
