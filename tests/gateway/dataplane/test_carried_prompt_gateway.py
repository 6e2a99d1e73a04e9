"""The carried prompt through the real gateway and a real tiny engine: a plain chat and a text
completion reach the engine with admission's token ids (the engine counts each in
``portico:prompts_carried``), a request with tools or content parts travels unchanged, and a
client's own ``portico_prompt_token_ids`` changes nothing. Field-level checks:
test_carried_prompt.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from portico.contract import PROMPT_IDS_FIELD
from tests.gateway.dataplane.harness import GatewayProcess, tiny_engine

pytestmark = pytest.mark.slow

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Which river runs through the old town?"}],
    "max_tokens": 5,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_server: Any, tiny_llama_dir: Path) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        module_tmp,
        {"redis": {"url": redis_server.url}, "engines": [tiny_engine(tiny_llama_dir, "tiny")]},
        {"tiers": [{"name": "small", "model": "tiny"}]},
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def carried(gw: GatewayProcess) -> dict[str, float]:
    transport = httpx.HTTPTransport(uds=str(gw.workdir / "run" / "tiny-0.sock"))
    with httpx.Client(transport=transport, base_url="http://engine") as engine:
        text = engine.get("/metrics").text
    found = {}
    for line in text.splitlines():
        if line.startswith("portico:prompts_carried_total{"):
            found[line.split('endpoint="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return found


def post(gw: GatewayProcess, key: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(
        gw.base_url + path, headers={"authorization": f"Bearer {key}"}, json=body, timeout=120
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_plain_requests_carry_their_ids_and_others_do_not(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant()
    before = carried(gateway)
    chat = post(gateway, key, "/v1/chat/completions", CHAT)
    completion = {"model": "tiny", "prompt": "The river", "max_tokens": 5, "temperature": 0}
    post(gateway, key, "/v1/completions", completion)
    after = carried(gateway)
    assert after["chat"] == before["chat"] + 1
    assert after["completions"] == before["completions"] + 1
    # a client's own field: the gateway's value (appended last) is the one the engine reads
    forged = post(gateway, key, "/v1/chat/completions", {**CHAT, PROMPT_IDS_FIELD: [5, 6]})
    assert forged["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert forged["choices"][0]["message"] == chat["choices"][0]["message"]
    before = carried(gateway)
    parts = [{"type": "text", "text": "Which river runs through the old town?"}]
    uncarried = post(
        gateway,
        key,
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": parts}]},
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    post(gateway, key, "/v1/chat/completions", {**CHAT, "tools": [tool], "tool_choice": "required"})
    assert carried(gateway) == before
    assert uncarried["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
