"""``/v1/embeddings`` and ``/v1/responses`` on a real engine process, through the real
``openai`` client (which asks for base64 embeddings by default and parses every Responses
stream event into its typed models)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest
from engine_server_process import MODEL_NAME, EngineProcess

pytestmark = pytest.mark.slow

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
POINT = {  # bounded: every value is short, so the reply ends within max_output_tokens
    "type": "object",
    "properties": {"x": {"enum": [1, 2, 3]}, "up": {"type": "boolean"}},
    "required": ["x", "up"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(hermes_engine_server: EngineProcess) -> EngineProcess:
    """The session's tiny engine with the Hermes tool parser (tests/conftest.py)."""
    return hermes_engine_server


@pytest.fixture(scope="module")
def client(engine: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key=engine.api_key, max_retries=0)


def test_embeddings_float_and_base64_agree_for_text_and_token_ids(client: openai.OpenAI) -> None:
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    as_base64 = client.embeddings.create(model=MODEL_NAME, input=texts)  # the SDK's default
    as_float = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    assert [d.index for d in as_float.data] == [0, 1]
    for a, b in zip(as_base64.data, as_float.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, rtol=1e-6)
        assert abs(np.linalg.norm(b.embedding) - 1.0) < 1e-4  # normalised
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens > 0
    alone = client.embeddings.create(model=MODEL_NAME, input=texts[1], encoding_format="float")
    np.testing.assert_allclose(alone.data[0].embedding, as_float.data[1].embedding, atol=1e-5)
    ids = client.embeddings.create(model=MODEL_NAME, input=[[1, 2, 3], [4, 5]])
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 5


def test_embeddings_bad_input_is_refused_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_NAME, input="hello", dimensions=8)
    assert info.value.body["param"] == "dimensions"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_NAME, input=[])
    assert info.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL_NAME, input=[[10**9]])
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_NAME, input="hi " * 400)
    assert info.value.code == "context_length_exceeded"
    cut = client.embeddings.create(
        model=MODEL_NAME, input="hi " * 400, extra_body={"truncate_prompt_tokens": 50}
    )
    assert cut.usage.prompt_tokens == 50
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hello")


def test_prompt_logprobs_and_echo_equal_transformers_log_softmax(
    client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    prompt = "The lighthouse keeper climbed the stairs"
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=2,
        extra_body={"prompt_logprobs": 3},
    )  # fmt: skip
    ids = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode(prompt)
    model = LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    choice = echoed.choices[0]
    assert choice.text.startswith(prompt)
    vllm_style = choice.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(vllm_style) == len(ids) and vllm_style[0] is None
    legacy = choice.logprobs
    assert legacy is not None and legacy.token_logprobs is not None
    assert legacy.token_logprobs[0] is None and len(legacy.token_logprobs) == len(ids) + 1
    for p in range(1, len(ids)):
        expected = want[p - 1, ids[p]].item()
        assert vllm_style[p][str(ids[p])]["logprob"] == pytest.approx(expected, abs=1e-4)
        assert legacy.token_logprobs[p] == pytest.approx(expected, abs=1e-4)
        top = want[p - 1].topk(3).indices.tolist()
        ranked = sorted((v["rank"], int(k)) for k, v in vllm_style[p].items() if v["rank"])
        assert [tid for _, tid in ranked] == top


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    text = "one two three four five six seven eight nine ten " * 4
    cut = client.completions.create(
        model=MODEL_NAME, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": 5}
    )
    assert cut.usage is not None and cut.usage.prompt_tokens == 5
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": text}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 7},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 7
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL_NAME, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": 0}
        )
    assert info.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_responses_text_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME,
        instructions="Answer briefly.",
        input="Tell me about lighthouses.",
        max_output_tokens=6,
        temperature=0.0,
    )
    whole = client.responses.create(**kwargs)  # type: ignore[call-overload]
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.output[0].type == "message"
    assert whole.usage is not None and whole.usage.output_tokens <= 6
    assert whole.status in ("completed", "incomplete")
    kinds = []
    with client.responses.stream(**kwargs) as stream:  # type: ignore[arg-type]
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-1] == "response.completed"
    assert final.output_text == whole.output_text  # greedy: the same text
    assert final.usage is not None and final.usage.input_tokens == whole.usage.input_tokens


def test_responses_function_calls_and_their_outputs(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME,
        input="Pick a color.",
        tools=[PICK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0.0,
    )
    whole = client.responses.create(**kwargs)  # type: ignore[call-overload]
    [call] = [item for item in whole.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), PICK["parameters"])
    pieces = []
    with client.responses.stream(**kwargs) as stream:  # type: ignore[arg-type]
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
        final = stream.get_final_response()
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert "".join(pieces) == streamed.arguments == call.arguments
    follow = client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "user", "content": "Pick a color."},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "done"},
        ],
        tools=[PICK],
        tool_choice="none",
        max_output_tokens=4,
    )  # fmt: skip
    alone = client.responses.create(
        model=MODEL_NAME, input="Pick a color.", tools=[PICK], tool_choice="none",
        max_output_tokens=1,
    )  # fmt: skip
    assert follow.usage is not None and alone.usage is not None
    assert follow.usage.input_tokens > alone.usage.input_tokens  # the call and its output


def test_responses_text_format_json_schema(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model=MODEL_NAME,
        input="A point, please.",
        text={"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}},
        max_output_tokens=60,
        temperature=0.9,
        extra_body={"seed": 11},  # vLLM's extra: the same reply on every run
    )
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), POINT)


def test_responses_bad_input_is_refused_in_openai_shape(client: openai.OpenAI) -> None:
    for kwargs, param in [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].image_url"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0]"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL_NAME, **kwargs)  # type: ignore[call-overload]
        assert info.value.body["param"] == param, kwargs  # type: ignore[index]


def test_task_embed_serves_only_embeddings_with_the_flagged_pooling(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    logs = tmp_path_factory.mktemp("embed-engine")
    pooler = '{"pooling_type": "MEAN", "normalize": false, "matryoshka_dimensions": [16]}'
    extra = ["--task", "embed", "--pooler-config", pooler]
    server = EngineProcess(tiny_llama_dir, logs / "engine.log", extra=extra)
    try:
        server.wait_ready()
        client = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0
        )
        text = "Mean pooling over every prompt token"
        got = client.embeddings.create(model=MODEL_NAME, input=text, dimensions=16)
        ids = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode(text)
        model = LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32)
        with torch.no_grad():
            want = model.model(torch.tensor([ids])).last_hidden_state[0].mean(0)[:16]
        np.testing.assert_allclose(got.data[0].embedding, want.numpy(), rtol=1e-4, atol=1e-5)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.code == "unsupported_endpoint"
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model=MODEL_NAME, input=text, dimensions=8)
    finally:
        assert server.stop() == 0, server.logs()
