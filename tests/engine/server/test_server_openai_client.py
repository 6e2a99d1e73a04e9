"""The real `openai` client, sync and async, streaming and not, against a real engine process."""

from __future__ import annotations

import openai
import pytest
from engine_server_process import MAX_MODEL_LEN, MODEL_NAME, EngineProcess, metric

USER = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
# Long enough to fill whole KV blocks (16 tokens), so the prefix cache can hit.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 6


@pytest.fixture(scope="module")
def client(engine_server: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=engine_server.base_url + "/v1", api_key=engine_server.api_key, max_retries=0
    )


@pytest.fixture
def aclient(engine_server: EngineProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=engine_server.base_url + "/v1", api_key=engine_server.api_key, max_retries=0
    )


def test_models_list_names_the_served_model_with_its_context_length(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    # how it computes, and why: the test server's explicit --dtype float32, on a dense model
    # (no GGUF blocks for the batch invariant kernel)
    numerics = models[0].model_extra["numerics"]
    assert numerics == {"path": "float32", "dtype": "float32", "gguf_activations": "exact",
                        "reason": "--dtype float32", "batch_invariant": False,
                        "kv_cache_auto": "auto"}  # fmt: skip


def test_chat_completion_returns_text_and_usage(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=8)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= resp.usage.completion_tokens <= 8
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_a_replayed_assistant_message_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4)
    history = [*USER, first.choices[0].message, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=4)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_max_tokens_cut_reports_length(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_completion_tokens=5, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5


def test_omitted_max_tokens_runs_to_the_context_limit(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens + resp.usage.completion_tokens == MAX_MODEL_LEN


def test_n_choices_each_carry_their_index(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=4, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert 3 <= resp.usage.completion_tokens <= 12


def test_greedy_and_seeded_sampling_are_reproducible(client: openai.OpenAI) -> None:
    def run(**kw: object) -> str:
        return (
            client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=12, **kw)
            .choices[0]
            .message.content
        )

    assert run(temperature=0) == run(temperature=0)
    assert run(temperature=1.0, seed=1234) == run(temperature=1.0, seed=1234)


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    params = dict(
        model=MODEL_NAME,
        prompt="Hello there",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**params).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = client.completions.create(**params, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    params["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = client.completions.create(**params, stop=stop).choices[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_chat_stream_has_role_deltas_finish_and_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    full = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    streamed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == (
        full.choices[0].message.content
    )
    assert content  # sampled text arrived in deltas


def test_chat_logprobs_have_the_requested_alternatives(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
    assert "".join(i.token for i in content) == resp.choices[0].message.content


def test_vllm_extras_are_honoured(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=8,
        temperature=0.8,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 8,
            "skip_special_tokens": True,
            "priority": 1,
            "cache_salt": "team-a",
        },
    )
    assert resp.usage.completion_tokens == 8  # min_tokens == max_tokens forces the full length


def test_cache_salt_separates_prefix_caches(client: openai.OpenAI) -> None:
    def cached(salt: str) -> int:
        resp = client.completions.create(
            model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return resp.usage.prompt_tokens_details.cached_tokens

    cached("tenant-1")
    assert cached("tenant-1") > 0
    assert cached("tenant-2") == 0


def test_completions_accept_string_list_and_token_prompts(
    client: openai.OpenAI, engine_server: EngineProcess
) -> None:
    many = client.completions.create(model=MODEL_NAME, prompt=["a", "b c"], max_tokens=3, n=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    with engine_server.client() as http:
        ids = http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(
        model=MODEL_NAME, prompt="Hello world", max_tokens=4, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completions_echo_and_logprobs(client: openai.OpenAI) -> None:
    echoed = client.completions.create(model=MODEL_NAME, prompt="Echo me", max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("Echo me")
    lp = (
        client.completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=3, logprobs=2, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .logprobs
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(alts) <= 2 for alts in lp.top_logprobs)
    assert lp.text_offset[0] == 0


async def test_async_client_completion_and_stream(aclient: openai.AsyncOpenAI) -> None:
    resp = await aclient.completions.create(
        model=MODEL_NAME,
        prompt="Async",
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 4
    stream = await aclient.completions.create(
        model=MODEL_NAME,
        prompt="Async",
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert text == resp.choices[0].text and finish == "length"
    chat = await aclient.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=3)
    assert chat.choices[0].message.role == "assistant"
    await aclient.close()


def test_client_errors_map_to_openai_exceptions(
    client: openai.OpenAI, engine_server: EngineProcess
) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=USER)
    assert nf.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL_NAME, messages=USER, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    assert bad.value.body["param"] == "tool_choice"  # "auto" needs a tool-call parser
    wrong = openai.OpenAI(base_url=engine_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_metrics_match_the_requests_made(
    client: openai.OpenAI, engine_server: EngineProcess
) -> None:
    before = engine_server.metrics()
    responses = [
        client.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=5, extra_body={"ignore_eos": True}
        )
        for p in ("one", "two three", "four five six")
    ]
    after = engine_server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in responses)
    assert delta("vllm:generation_tokens_total") == 15
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 4
    assert delta("vllm:request_generation_tokens_sum") == 15
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    assert delta("vllm:prefix_cache_queries_total") >= delta("vllm:prefix_cache_hits_total") >= 0
    assert metric(after, "vllm:num_preemptions_total") >= 0
