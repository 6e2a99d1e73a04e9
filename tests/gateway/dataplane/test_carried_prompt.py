"""The prompt's token ids carried from the gateway to a local engine (portico/contract.py
"Carried prompt"): admission's ids travel in the body the gateway forwards, the engine takes
them instead of rendering and encoding (counted in ``portico:prompts_carried``) and answers
exactly as without them; a client's own field is never trusted, bad ids are a 400 naming the
field, and requests whose ids may not be the engine's travel unchanged."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.server.app import create_app
from engine.server.settings import ServerSettings
from gateway.admission.prompt_tokens import PromptCounter, load_tokenizer
from gateway.body.fields import parse_fields
from gateway.relay.carried_prompt import carried_prompt_ids, with_prompt_ids
from gateway.relay.usage_relay import upstream_body
from portico.contract import PROMPT_IDS_FIELD, PROMPT_IDS_HEADER, tokenizer_fingerprint

CHAT = {
    "model": "t",
    "messages": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Which river runs through the old town?"},
    ],
    "max_tokens": 6,
    "temperature": 0,
}
COMPLETION = {"model": "t", "prompt": "The river runs through", "max_tokens": 6, "temperature": 0}


@pytest.fixture
def hop(tiny_llama_dir: Path) -> dict[str, str]:
    """The gateway's header: its tokenizer's fingerprint, which is the engine's own."""
    return {PROMPT_IDS_HEADER: tokenizer_fingerprint(load_tokenizer(str(tiny_llama_dir)))}


@pytest.fixture
async def engine(tiny_llama_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A real tiny engine in this process, behind its HTTP app."""
    llm = AsyncLLMEngine.from_config(
        EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB", max_model_len=256)
    )
    app = create_app(llm, ServerSettings(served_model_name="t"))
    await llm.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://engine"
        ) as client:
            yield client
    finally:
        await llm.shutdown()


def gateway_body(body: dict[str, Any], kind: str, tokenizer: Any) -> tuple[bytes, list[int]]:
    """What the gateway forwards: admission counts, then the ids are appended."""
    raw = json.dumps(body).encode()
    fields = parse_fields(raw, kind)
    PromptCounter({"t": tokenizer}).count("t", fields)
    ids = carried_prompt_ids(tokenizer, fields)
    assert ids is not None
    return with_prompt_ids(upstream_body(raw, fields, "t", None, local_engine=True), ids), ids


async def carried(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    found = {}
    for line in text.splitlines():
        if line.startswith("portico:prompts_carried_total{"):
            endpoint = line.split('endpoint="')[1].split('"')[0]
            found[endpoint] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [("/v1/chat/completions", CHAT, "chat"), ("/v1/completions", COMPLETION, "completion")],
)
async def test_carried_ids_answer_exactly_as_rendering_and_skip_it(
    hop: dict[str, str],
    engine: httpx.AsyncClient,
    tiny_llama_dir: Path,
    path: str,
    body: dict[str, Any],
    kind: str,
) -> None:
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    plain = await engine.post(path, json=body)
    assert plain.status_code == 200, plain.text
    before = await carried(engine)
    payload, ids = gateway_body(body, kind, tokenizer)
    hop = await engine.post(path, content=payload, headers=hop)
    assert hop.status_code == 200, hop.text
    endpoint = "chat" if kind == "chat" else "completions"
    assert (await carried(engine))[endpoint] == before[endpoint] + 1
    a, b = plain.json(), hop.json()
    for count in ("prompt_tokens", "completion_tokens"):
        assert a["usage"][count] == b["usage"][count]
    assert b["usage"]["prompt_tokens"] == len(ids)
    if len(ids) >= 16:  # a whole block: the same ids hash to the first request's blocks
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    key = "message" if kind == "chat" else "text"
    assert [c[key] for c in a["choices"]] == [c[key] for c in b["choices"]]


async def test_a_clients_own_field_is_ignored_and_the_gateways_wins(
    hop: dict[str, str], engine: httpx.AsyncClient, tiny_llama_dir: Path
) -> None:
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    plain = (await engine.post("/v1/chat/completions", json=CHAT)).json()
    forged = {**CHAT, PROMPT_IDS_FIELD: [5, 6, 7]}
    before = await carried(engine)
    # without the gateway's header: ignored, even when malformed
    for value in ([5, 6, 7], "junk"):
        resp = await engine.post("/v1/chat/completions", json={**CHAT, PROMPT_IDS_FIELD: value})
        assert resp.status_code == 200
        assert resp.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert await carried(engine) == before
    # the client's duplicate key comes first; the gateway's, appended last, is the one read
    payload, _ = gateway_body(forged, "chat", tokenizer)
    resp = await engine.post("/v1/chat/completions", content=payload, headers=hop)
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert resp.json()["choices"][0]["message"] == plain["choices"][0]["message"]


@pytest.mark.parametrize("value", [[], [1, "2"], [1, 10**9], [True], "1,2", None])
async def test_bad_carried_ids_are_a_400_naming_the_field(
    hop: dict[str, str], engine: httpx.AsyncClient, value: Any
) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        resp = await engine.post(path, json={**body, PROMPT_IDS_FIELD: value}, headers=hop)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == PROMPT_IDS_FIELD


@pytest.mark.parametrize(
    "body",
    [
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {
            **CHAT,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ],
        },
        {**CHAT, "messages": [{"role": "user", "content": "Hi", "name": "ann"}]},
        {**COMPLETION, "prompt": ["one", "two"]},
    ],
)
def test_ids_that_may_not_be_the_engines_are_not_carried(
    tiny_llama_dir: Path, body: dict[str, Any]
) -> None:
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    kind = "chat" if "messages" in body else "completion"
    fields = parse_fields(json.dumps(body).encode(), kind)
    PromptCounter({"t": tokenizer}).count("t", fields)
    assert carried_prompt_ids(tokenizer, fields) is None
    # another tokenizer object than the one admission counted with: not carried either
    plain = parse_fields(json.dumps(CHAT).encode(), "chat")
    PromptCounter({"t": tokenizer}).count("t", plain)
    assert carried_prompt_ids(load_tokenizer(str(tiny_llama_dir)), plain) is None


async def test_the_engine_renders_when_tools_come_with_carried_ids(
    hop: dict[str, str],
    engine: httpx.AsyncClient,
) -> None:
    """A tools request never gets the header from the gateway; were it to, the engine would
    still render (the tools change the prompt)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {**CHAT, "tools": [tool], "tool_choice": "required"}
    plain = await engine.post("/v1/chat/completions", json=body)
    before = await carried(engine)
    hop = await engine.post(
        "/v1/chat/completions", json={**body, PROMPT_IDS_FIELD: [5, 6]}, headers=hop
    )
    assert hop.status_code == plain.status_code == 200, hop.text
    assert hop.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    assert await carried(engine) == before


async def test_ids_made_by_another_tokenizer_are_declined(
    engine: httpx.AsyncClient, tiny_llama_dir: Path
) -> None:
    """A header whose fingerprint is not the engine's tokenizer's (another chat template or
    vocabulary): the engine renders and encodes itself and answers as without the ids."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    plain = (await engine.post("/v1/chat/completions", json=CHAT)).json()
    payload, _ = gateway_body(CHAT, "chat", tokenizer)
    wrong = payload.replace(
        b'"%s":[' % PROMPT_IDS_FIELD.encode(), b'"%s":[7,' % PROMPT_IDS_FIELD.encode()
    )
    before = await carried(engine)
    resp = await engine.post(
        "/v1/chat/completions", content=wrong, headers={PROMPT_IDS_HEADER: "0123456789abcdef"}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert resp.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    assert await carried(engine) == before
