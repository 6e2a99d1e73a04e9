"""Embeddings, the Responses API (stored per tenant) and tokenize/detokenize through a real
``portico serve`` supervising a real tiny engine, with real Redis and the real ``openai``
client holding a tenant's key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.gateway.dataplane.harness import GatewayProcess, live_slots, tiny_engine

pytestmark = pytest.mark.slow

ROUTING = {"tiers": [{"name": "small", "model": "tiny"}]}


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_server: Any, tiny_llama_dir: Path) -> Iterator[GatewayProcess]:
    engine = tiny_engine(tiny_llama_dir, "tiny")
    engine["long_prompts"] = "truncate_left"
    gw = GatewayProcess(
        module_tmp, {"redis": {"url": redis_server.url}, "engines": [engine]}, ROUTING
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def client_for(gateway: GatewayProcess) -> tuple[str, openai.OpenAI]:
    tenant, key = gateway.create_tenant("standard")
    return tenant, openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def tenant_client(gateway: GatewayProcess) -> tuple[str, openai.OpenAI]:
    return client_for(gateway)


@pytest.fixture(scope="module")
def client(tenant_client: tuple[str, openai.OpenAI]) -> openai.OpenAI:
    return tenant_client[1]


def test_embeddings_through_the_gateway_reserve_the_prompt_tokens(
    gateway: GatewayProcess, redis_server: Any
) -> None:
    tenant, fresh = client_for(gateway)
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    raw = fresh.embeddings.with_raw_response.create(model="tiny", input=texts)
    batch = raw.parse()  # base64 on the wire: the SDK's default
    limit = int(raw.headers["x-ratelimit-limit-tokens"])
    reserved = limit - int(raw.headers["x-ratelimit-remaining-tokens"])
    assert batch.usage.prompt_tokens > 0 and reserved == batch.usage.prompt_tokens
    alone = fresh.embeddings.create(model="tiny", input=texts[0], encoding_format="float")
    np.testing.assert_allclose(alone.data[0].embedding, batch.data[0].embedding, atol=1e-5)
    ids = fresh.embeddings.create(model="tiny", input=[5, 6, 7], encoding_format="float")
    assert ids.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        fresh.embeddings.create(model="tiny", input="x", dimensions=4)
    assert info.value.body["param"] == "dimensions"  # type: ignore[index]
    assert live_slots(redis_server.url, tenant) == 0


def test_responses_chain_through_previous_response_id(
    gateway: GatewayProcess, client: openai.OpenAI
) -> None:
    first = client.responses.create(
        model="tiny", input="Name a color.", max_output_tokens=5, temperature=0.0
    )
    assert first.usage is not None
    second = client.responses.create(
        model="tiny",
        input="And another one?",
        previous_response_id=first.id,
        max_output_tokens=5,
        temperature=0.0,
    )
    alone = client.responses.create(
        model="tiny", input="And another one?", max_output_tokens=5, temperature=0.0
    )
    assert second.usage is not None and alone.usage is not None
    # The engine saw the earlier turns (the first input and its answer) before the new one:
    # exactly the prompt of that conversation written out as chat messages.
    conversation = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another one?"},
    ]
    counted = httpx.post(
        gateway.base_url + "/tokenize",
        json={"model": "tiny", "messages": conversation},
        headers={"authorization": f"Bearer {client.api_key}"},
    ).json()["count"]
    assert second.usage.input_tokens == counted
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    kept = client.responses.retrieve(first.id)
    assert kept.id == first.id and kept.output_text == first.output_text
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [item.type for item in items] == ["message", "message", "message"]
    assert [item.role for item in items] == ["user", "assistant", "user"]  # type: ignore[union-attr]
    assert all(item.id for item in items)
    newest = client.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].id == items[-1].id and newest.has_more


def test_streamed_response_is_stored_and_chained(client: openai.OpenAI) -> None:
    kinds = []
    with client.responses.stream(
        model="tiny", input="Say hello.", max_output_tokens=6, temperature=0.0
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert client.responses.retrieve(final.id).output_text == final.output_text
    with client.responses.stream(
        model="tiny",
        input="Again.",
        previous_response_id=final.id,
        max_output_tokens=3,
    ) as stream:
        chained = stream.get_final_response()
    assert chained.usage is not None and final.usage is not None
    assert chained.usage.input_tokens > final.usage.input_tokens


def test_stored_responses_belong_to_their_tenant(
    gateway: GatewayProcess, client: openai.OpenAI
) -> None:
    mine = client.responses.create(model="tiny", input="Hi.", max_output_tokens=2)
    _, other = client_for(gateway)
    with pytest.raises(openai.NotFoundError) as info:
        other.responses.retrieve(mine.id)
    assert info.value.body["code"] == "response_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        other.responses.create(
            model="tiny", input="Hi.", previous_response_id=mine.id, max_output_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    client.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine.id)
    unstored = client.responses.create(model="tiny", input="Hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_bad_input_in_openai_shape(client: openai.OpenAI) -> None:
    for kwargs, param in [
        ({"input": []}, "input"),
        ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "hi", "previous_response_id": 5}, "previous_response_id"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="tiny", **kwargs)  # type: ignore[call-overload]
        assert info.value.body["param"] == param, kwargs  # type: ignore[index]


def test_tokenize_and_detokenize_through_the_gateway(
    gateway: GatewayProcess, client: openai.OpenAI
) -> None:
    headers = {"authorization": f"Bearer {client.api_key}"}
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=30) as http:
        tokens = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 1024
        text = http.post("/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]})
        assert "Hello world" in text.json()["prompt"]
        chat = http.post(
            "/tokenize",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hello world"}]},
        ).json()
        assert chat["count"] > tokens["count"]  # the chat template's turn markers
        bad = http.post("/tokenize", json={"prompt": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
        unauthenticated = httpx.post(gateway.base_url + "/tokenize", json={"model": "tiny"})
        assert unauthenticated.status_code == 401


def test_a_conversation_over_the_context_is_cut_by_the_models_policy(
    client: openai.OpenAI,
) -> None:
    history: list[Any] = [{"role": "system", "content": "Be brief."}]
    for i in range(24):
        role = "user" if i % 2 == 0 else "assistant"
        history.append({"role": role, "content": f"turn {i}: " + "many words here " * 20})
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=history, temperature=0.0, max_tokens=8
    )
    reply = raw.parse()
    assert raw.headers["x-portico-prompt-truncated"].startswith("truncate_left; dropped_")
    assert reply.usage is not None and reply.usage.prompt_tokens + 8 <= 1024
    fits = client.chat.completions.with_raw_response.create(
        model="tiny", messages=history[-3:], max_tokens=2
    )
    assert "x-portico-prompt-truncated" not in fits.headers


def test_echo_and_prompt_logprobs_through_the_gateway(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", prompt="Score this text", max_tokens=2, echo=True, logprobs=1,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.logprobs is not None and whole.logprobs.token_logprobs is not None
    assert whole.logprobs.token_logprobs[0] is None
    assert whole.model_extra["prompt_logprobs"][0] is None  # type: ignore[index]
    first = next(iter(client.completions.create(stream=True, **kwargs))).choices[0]
    assert first.text == "Score this text" and first.logprobs is not None
    assert (
        first.logprobs.token_logprobs
        == whole.logprobs.token_logprobs[: len(first.logprobs.token_logprobs)]
    )


PICK = {
    "type": "function",
    "name": "pick_color",
    "parameters": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
}


def test_a_function_call_answered_through_previous_response_id(client: openai.OpenAI) -> None:
    # The Agents SDK's loop: the model calls a function (streamed), the application sends the
    # result as a function_call_output item chained to the stored response. No
    # max_output_tokens: the gateway sends the cap it reserved under the Responses name.
    pieces = []
    with client.responses.stream(
        model="tiny",
        input="Pick a color.",
        tools=[PICK],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
    ) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
        called = stream.get_final_response()
    [call] = [item for item in called.output if item.type == "function_call"]
    assert "".join(pieces) == call.arguments and call.name == "pick_color"
    answered = client.responses.create(
        model="tiny",
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "done"}],
        tools=[PICK],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=3,
    )
    unchained = client.responses.create(
        model="tiny",
        input="Pick a color.",
        tools=[PICK],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=1,
    )
    assert answered.usage is not None and unchained.usage is not None
    # The stored turn (the user's question and the call) and the call's output came first.
    assert answered.usage.input_tokens > unchained.usage.input_tokens
