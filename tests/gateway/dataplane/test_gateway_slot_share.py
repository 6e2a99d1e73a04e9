"""Slot share through the gateway: ``portico serve`` (embedded Redis, real keys, the packaged
plans) in front of a real tiny engine with two running slots, under the fair policy.

Tenant N holds both slots with two long streamed chats; tenant Q's short chat then finishes
while both of N's are still streaming, which only a slot taken back from N allows (with every
slot N's, Q would wait for one of them to end). The engine's per-tenant view shows the slot
shares, N's preempted chat still ends with every token it asked for, and a plan's
``max_running`` holds a tenant to that many running requests on the engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.dataplane.harness import ADMIN_KEY, GatewayProcess, tiny_engine

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
PLANS = """
default_plan: enterprise
plans:
  enterprise: {max_concurrency: 16}
  capped: {max_concurrency: 16, max_running: 1}
"""
LONG = 900  # output tokens of N's chats: the tiny model's context is 1024

pytestmark = pytest.mark.slow  # a gateway and a tiny engine start: ~30 s on 2 cores


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[Any]:
    workdir = tmp_path_factory.mktemp("slot-share")
    (workdir / "plans.yaml").write_text(PLANS)
    engine = tiny_engine(tiny_llama_dir, "tiny")
    engine["args"][engine["args"].index("--max-num-seqs") + 1] = "2"
    gw = GatewayProcess(
        workdir,
        {
            "engines": [engine],
            "engine": {"scheduling": "fair"},
            "redis": {"plans_file": str(workdir / "plans.yaml")},
        },
        routing={},
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def _client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=gateway.base_url + "/v1", max_retries=0)


def _tenant_rows(gateway: GatewayProcess) -> dict[str, dict[str, Any]]:
    resp = httpx.get(gateway.base_url + "/admin/v1/engines", headers=ADMIN, timeout=30)
    assert resp.status_code == 200, resp.text
    (engine,) = resp.json()["data"]
    return {row["tenant"]: row for row in engine["tenants"] or []}


class LongChat(threading.Thread):
    """One long streamed chat in a thread: when its first token came, when it ended."""

    def __init__(self, client: openai.OpenAI, content: str, max_tokens: int = LONG) -> None:
        super().__init__(daemon=True)
        self.client, self.content, self.max_tokens = client, content, max_tokens
        self.started = threading.Event()
        self.done = threading.Event()
        self.completion_tokens = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": self.content}],
                max_tokens=self.max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                self.started.set()
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()
            self.done.set()


def _wait(predicate: Any, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def test_a_tenant_gets_a_slot_back_while_another_holds_every_one(gateway: GatewayProcess) -> None:
    noisy_id, noisy_key = gateway.create_tenant("enterprise")
    quiet_id, quiet_key = gateway.create_tenant("enterprise")
    chats = [LongChat(_client(gateway, noisy_key), f"story number {i}") for i in range(2)]
    for chat in chats:
        chat.start()
    _wait(lambda: all(c.started.is_set() for c in chats), "N's chats stream")
    rows = _tenant_rows(gateway)
    assert rows[noisy_id]["running"] == 2, rows  # every slot is N's
    answer = _client(gateway, quiet_key).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    still_streaming = [not c.done.is_set() for c in chats]
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert still_streaming == [True, True]  # Q did not wait for either of N's chats to end
    rows = _tenant_rows(gateway)
    # the engine counted Q's prompt and decodes (its first token comes from the prefill step)
    assert rows[quiet_id]["prompt_tokens"] > 0 and rows[quiet_id]["generation_tokens"] == 3
    for chat in chats:
        chat.join(300)
        assert chat.error is None and chat.completion_tokens == LONG
    resp = httpx.get(gateway.base_url + "/admin/v1/engines", headers=ADMIN, timeout=30)
    assert resp.json()["data"][0]["metrics"]["preemptions"] >= 1  # N's newest gave its slot


def test_a_plans_max_running_holds_a_tenant_to_that_many_slots(gateway: GatewayProcess) -> None:
    capped_id, capped_key = gateway.create_tenant("capped")
    client = _client(gateway, capped_key)
    chats = [LongChat(client, f"tale number {i}", max_tokens=200) for i in range(2)]
    for chat in chats:
        chat.start()
    _wait(lambda: any(c.started.is_set() for c in chats), "a capped chat streams")
    seen = []
    while not all(c.done.is_set() for c in chats):
        row = _tenant_rows(gateway).get(capped_id)
        if row is not None:
            seen.append((row["running"], row["waiting"]))
        time.sleep(0.05)
    assert seen and max(running for running, _ in seen) == 1
    assert any(waiting == 1 for _, waiting in seen)  # the second chat waited, a slot was free
    for chat in chats:
        assert chat.error is None and chat.completion_tokens == 200
