"""Raw HTTP against a real engine process: SSE framing, bad input, auth, disconnects, probes."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest
from engine_server_process import API_KEY, MAX_MODEL_LEN, MODEL_NAME, EngineProcess, metric

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
SETTLE_TIMEOUT_S = 60.0  # how long the engine may take to process an abort on a busy machine


@pytest.fixture(scope="module")
def http(engine_server: EngineProcess) -> httpx.Client:
    return engine_server.client()


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and len(body["error"]["message"]) <= 500
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def wait_until_idle(server: EngineProcess) -> dict:
    """Poll /metrics until the engine runs nothing (bounded), and return the last reading."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        samples = server.metrics()
        idle = (
            metric(samples, "vllm:num_requests_running") == 0
            and metric(samples, "vllm:num_requests_waiting") == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


# ---------------------------------------------------------------------------- SSE framing


def test_chat_sse_frames_are_exactly_openais(http: httpx.Client) -> None:
    body = dict(
        CHAT, max_tokens=3, stream=True, stream_options={"include_usage": True}, ignore_eos=True
    )
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    events = events[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    first, *middle, finish, usage = payloads
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["object"] == "chat.completion.chunk"
    assert all(p["choices"][0]["delta"].keys() == {"content"} for p in middle)
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert len({p["id"] for p in payloads}) == 1


def test_completion_sse_frames(http: httpx.Client) -> None:
    body = dict(COMPLETION, max_tokens=2, stream=True, ignore_eos=True)
    with http.stream("POST", "/v1/completions", json=body) as resp:
        lines = [line for line in resp.iter_lines()]
    data = [line for line in lines if line]
    assert data[-1] == "data: [DONE]"
    payloads = [json.loads(line[len("data: ") :]) for line in data[:-1]]
    assert all(p["object"] == "text_completion" and "usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------- bad input

BAD_CHAT: list[tuple[str, dict[str, Any], str | None]] = [
    ("temperature wrong type", {"temperature": "hot"}, "temperature"),
    ("temperature out of range", {"temperature": 2.5}, "temperature"),
    ("top_p zero", {"top_p": 0}, "top_p"),
    ("top_p above one", {"top_p": 1.5}, "top_p"),
    ("n zero", {"n": 0}, "n"),
    ("n string", {"n": "2"}, "n"),
    ("n too many", {"n": 1000}, "n"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens string", {"max_tokens": "10"}, "max_tokens"),
    ("max_tokens beyond context", {"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("max_completion_tokens negative", {"max_completion_tokens": -1}, "max_completion_tokens"),
    ("stop wrong type", {"stop": 5}, "stop"),
    ("stop list with number", {"stop": ["a", 1]}, "stop[1]"),
    ("stop empty string", {"stop": [""]}, "stop"),
    ("seed string", {"seed": "x"}, "seed"),
    ("seed too large", {"seed": 2**70}, "seed"),
    ("presence_penalty out of range", {"presence_penalty": 3}, "presence_penalty"),
    ("frequency_penalty out of range", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("logit_bias non-numeric key", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias value out of range", {"logit_bias": {"1": 500}}, "logit_bias.1"),
    ("logit_bias token outside vocab", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("logprobs wrong type", {"logprobs": "yes"}, "logprobs"),
    ("top_logprobs too many", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("stream wrong type", {"stream": "yes"}, "stream"),
    (
        "stream_options without stream",
        {"stream_options": {"include_usage": True}},
        "stream_options",
    ),
    (
        "stream_options wrong type",
        {"stream_options": {"include_usage": "y"}},
        "stream_options.include_usage",
    ),
    ("stream_options unknown field", {"stream_options": {"foo": True}}, "stream_options.foo"),
    ("user wrong type", {"user": 5}, "user"),
    ("top_k below -1", {"top_k": -2}, "top_k"),
    ("min_p above one", {"min_p": 2}, "min_p"),
    ("repetition_penalty zero", {"repetition_penalty": 0}, "repetition_penalty"),
    ("min_tokens negative", {"min_tokens": -1}, "min_tokens"),
    ("min_tokens above max_tokens", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("ignore_eos wrong type", {"ignore_eos": "no"}, "ignore_eos"),
    ("stop_token_ids negative", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop_token_ids outside vocab", {"stop_token_ids": [99999999]}, "stop_token_ids"),
    ("skip_special_tokens wrong type", {"skip_special_tokens": 1}, "skip_special_tokens"),
    (
        "include_stop_str_in_output wrong type",
        {"include_stop_str_in_output": "x"},
        "include_stop_str_in_output",
    ),
    ("cache_salt empty", {"cache_salt": ""}, "cache_salt"),
    ("cache_salt wrong type", {"cache_salt": 5}, "cache_salt"),
    ("priority wrong type", {"priority": "high"}, "priority"),
    ("messages empty", {"messages": []}, "messages"),
    ("messages wrong type", {"messages": "hi"}, "messages"),
    ("role unknown", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (
        "tool message without tool_call_id",
        {"messages": [{"role": "tool", "content": "x"}]},
        "messages[0]",
    ),
    (
        "image content part on a text-only model",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        },
        "messages[0].content[0].image_url.url",
    ),
    (
        "image URL of an unknown scheme",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "file:///etc/x"}}],
                }
            ]
        },
        "messages[0].content[0].image_url.url",
    ),
    (
        "message unknown field",
        {"messages": [{"role": "user", "content": "x", "foo": 1}]},
        "messages[0].foo",
    ),
    (
        "tool call without its function",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "1", "type": "function"}],
                },
                {"role": "user", "content": "x"},
            ]
        },
        "messages[0].tool_calls[0].function",
    ),
    ("unknown field", {"foo": 1}, "foo"),
    ("model missing", {"model": None}, "model"),
    ("tools wrong type", {"tools": {"type": "function"}}, "tools"),
    (
        "tool name with a space",
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools[0].function.name",
    ),
    (
        "tool of another type",
        {"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]},
        "tools[0].type",
    ),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool_choice unknown word", {"tool_choice": "always"}, "tool_choice"),
    (
        "tool_choice names an unknown function",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    (
        "auto tool choice without a parser on the server",
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "tool_choice",
    ),
    (
        "tool parameters not an object schema",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    (
        "two tools with one name",
        {
            "tools": [
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "f"}},
            ],
            "tool_choice": "required",
        },
        "tools[1].function.name",
    ),
    ("parallel_tool_calls wrong type", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("unsupported functions", {"functions": [{"name": "f"}]}, "functions"),
    ("unsupported function_call", {"function_call": "auto"}, "function_call"),
    ("response_format unknown type", {"response_format": {"type": "xml"}}, "response_format.type"),
    (
        "response_format json_schema without json_schema",
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
    (
        "response_format schema with an unsupported keyword",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        "response_format schema that is not a schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": 1}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        "structured_outputs with two constraints",
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs",
    ),
    (
        "structured_outputs unknown key",
        {"structured_outputs": {"xml": "a"}},
        "structured_outputs.xml",
    ),
    (
        "structured_outputs bad regex",
        {"structured_outputs": {"regex": "(a"}},
        "structured_outputs.regex",
    ),
    ("guided_grammar bad EBNF", {"guided_grammar": "root ::= ("}, "guided_grammar"),
    ("guided_choice empty", {"guided_choice": []}, "guided_choice"),
    (
        "guided_decoding_backend outlines",
        {"guided_decoding_backend": "outlines", "guided_regex": "a"},
        "guided_decoding_backend",
    ),
    (
        "two structured-output fields",
        {"guided_regex": "a", "response_format": {"type": "json_object"}},
        "guided_regex",
    ),
    ("unsupported audio", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("unsupported modalities", {"modalities": ["text", "audio"]}, "modalities"),
    ("unsupported store", {"store": True}, "store"),
]

BAD_COMPLETION: list[tuple[str, dict[str, Any], str | None]] = [
    ("prompt wrong type", {"prompt": 5}, "prompt"),
    ("prompt empty list", {"prompt": []}, "prompt"),
    ("prompt empty string", {"prompt": ""}, "prompt"),
    ("prompt mixed token list", {"prompt": [[1, "a"]]}, "prompt[0][1]"),
    ("prompt token outside vocab", {"prompt": [99999999]}, "prompt[0]"),
    ("prompt longer than the context", {"prompt": [1] * (MAX_MODEL_LEN + 5)}, "prompt"),
    ("echo wrong type", {"echo": "yes"}, "echo"),
    ("logprobs too many", {"logprobs": 21}, "logprobs"),
    ("logprobs wrong type", {"logprobs": "x"}, "logprobs"),
    ("unsupported suffix", {"suffix": "end"}, "suffix"),
    ("unsupported best_of", {"best_of": 3}, "best_of"),
    ("guided_json not a schema", {"guided_json": "{not json"}, "guided_json"),
    ("unknown field", {"messages": []}, "messages"),
]


def _body(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    body = dict(base, **change)
    return {k: v for k, v in body.items() if v is not None}


@pytest.fixture(scope="module")
def metrics_before_bad_input(engine_server: EngineProcess) -> dict:
    return wait_until_idle(engine_server)


@pytest.mark.parametrize(("case", "change", "param"), BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_parameter_is_a_400_naming_it(
    http: httpx.Client,
    metrics_before_bad_input: dict,
    case: str,
    change: dict,
    param: str | None,
) -> None:
    error = assert_openai_error(
        http.post("/v1/chat/completions", json=_body(CHAT, change)), 400, param
    )
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("case", "change", "param"), BAD_COMPLETION, ids=[c[0] for c in BAD_COMPLETION]
)
def test_bad_completion_parameter_is_a_400_naming_it(
    http: httpx.Client,
    metrics_before_bad_input: dict,
    case: str,
    change: dict,
    param: str | None,
) -> None:
    assert_openai_error(http.post("/v1/completions", json=_body(COMPLETION, change)), 400, param)


def test_prompt_too_long_says_what_was_asked_and_allowed(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json=dict(COMPLETION, prompt=[1] * 200, max_tokens=100))
    error = assert_openai_error(resp, 400, "max_tokens")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert "requested 300 tokens (200 in the prompt, 100 in the completion)" in error["message"]
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", '"caf\u00e9"'.encode()])
def test_malformed_body_is_a_400(http: httpx.Client, path: str, raw: bytes) -> None:
    resp = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(resp, 400)


def test_oversized_body_is_a_413(http: httpx.Client) -> None:
    huge = dict(COMPLETION, prompt="x" * (5 * 1024 * 1024))
    error = assert_openai_error(http.post("/v1/completions", json=huge), 413)
    assert error["code"] == "request_too_large"


def test_oversized_chunked_body_without_length_is_a_413(http: httpx.Client) -> None:
    def chunks():  # no Content-Length: the limit must be counted as the body arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(5 * 1024):
            yield b"x" * 1024
        yield b'"}'

    resp = http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert "content-length" not in resp.request.headers
    assert_openai_error(resp, 413)


def test_unknown_model_is_a_404(http: httpx.Client) -> None:
    error = assert_openai_error(
        http.post("/v1/completions", json=dict(COMPLETION, model="x")), 404, "model"
    )
    assert error["code"] == "model_not_found"


def test_bad_input_left_nothing_behind(
    engine_server: EngineProcess, metrics_before_bad_input: dict
) -> None:
    after = wait_until_idle(engine_server)
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert metric(after, name) == metric(metrics_before_bad_input, name), name
    assert metric(after, "vllm:kv_cache_usage_perc") == 0


# ---------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    "header", [None, "Bearer wrong-key", f"Basic {API_KEY}", f"Bearer {API_KEY}x", "Bearer"]
)
@pytest.mark.parametrize(
    "path", ["/v1/models", "/v1/completions", "/tokenize", "/version", "/no-such-route"]
)
def test_missing_or_wrong_key_is_a_401(
    engine_server: EngineProcess, header: str | None, path: str
) -> None:
    headers = {"Authorization": header} if header else {}
    with httpx.Client(base_url=engine_server.base_url, timeout=30) as anon:
        resp = anon.request(
            "GET" if path in ("/v1/models", "/version") else "POST",
            path,
            headers=headers,
            json=COMPLETION,
        )
    error = assert_openai_error(resp, 401)
    assert error["type"] == "authentication_error"


def test_probes_and_metrics_need_no_key(engine_server: EngineProcess) -> None:
    with httpx.Client(base_url=engine_server.base_url, timeout=30) as anon:
        assert anon.get("/health").json() == {"status": "ok"}
        assert anon.get("/ready").status_code == 200
        assert "vllm:num_requests_running" in anon.get("/metrics").text


# ---------------------------------------------------------------------------- other routes


def test_tokenize_detokenize_round_trip_and_version(http: httpx.Client) -> None:
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = http.post("/tokenize", json={"messages": CHAT["messages"]}).json()
    assert chat["count"] > tokens["count"]
    assert_openai_error(http.post("/detokenize", json={"tokens": [-5]}), 400, "tokens")
    assert http.get("/version").json()["version"]


# ---------------------------------------------------------------------------- disconnects


def _raw_request(server: EngineProcess, path: str, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    payload = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: engine\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def _wait_running(server: EngineProcess) -> dict:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        samples = server.metrics()
        if metric(samples, "vllm:num_requests_running") >= 1:
            return samples
        time.sleep(0.02)
    raise AssertionError("the request never started running")


LONG = {"max_tokens": MAX_MODEL_LEN - 40, "ignore_eos": True}


def _settle_after_abort(server: EngineProcess, before: dict) -> dict:
    """Wait (bounded) until the abort is recorded and the engine reports nothing running."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        samples = server.metrics()
        settled = (
            _aborts(samples) > _aborts(before) and metric(samples, "vllm:num_requests_running") == 0
        )
        if settled or time.monotonic() > deadline:
            return samples
        time.sleep(0.02)


def _aborts(samples: dict) -> float:
    return metric(samples, "vllm:request_success_total", finished_reason="abort")


def test_stream_disconnect_aborts_and_frees_kv(engine_server: EngineProcess) -> None:
    before = wait_until_idle(engine_server)
    sock = _raw_request(engine_server, "/v1/completions", dict(COMPLETION, stream=True, **LONG))
    received = b""
    while b"data: " not in received:  # wait for the stream's first event
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    assert metric(engine_server.metrics(), "vllm:kv_cache_usage_perc") > 0
    sock.close()
    after = _settle_after_abort(engine_server, before)
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    assert _aborts(after) - _aborts(before) == 1
    generated = metric(after, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total"
    )
    assert generated < LONG["max_tokens"]


def test_non_streaming_disconnect_aborts_and_frees_kv(engine_server: EngineProcess) -> None:
    before = wait_until_idle(engine_server)
    sock = _raw_request(engine_server, "/v1/chat/completions", dict(CHAT, **LONG))
    _wait_running(engine_server)
    sock.close()
    after = _settle_after_abort(engine_server, before)
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    assert _aborts(after) - _aborts(before) == 1
    generated = metric(after, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total"
    )
    assert generated < LONG["max_tokens"]


def test_streaming_many_prompts_and_choices_indexes_every_choice(http: httpx.Client) -> None:
    body = dict(
        COMPLETION,
        prompt=["one", "two"],
        n=2,
        max_tokens=3,
        stream=True,
        echo=True,
        ignore_eos=True,
        logprobs=1,
    )
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200  # echo with logprobs: the prompt's logprobs come first
    echoed = [json.loads(line[6:]) for line in resp.text.splitlines() if line[6:7] == "{"]
    first: dict[int, Any] = {}
    for c in (c for e in echoed for c in e["choices"] if c["logprobs"]):
        first.setdefault(c["index"], c)
    assert sorted(first) == [0, 1, 2, 3] and first[0]["logprobs"]["token_logprobs"][0] is None
    body.pop("logprobs")
    with http.stream("POST", "/v1/completions", json=body) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    choices = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
    texts: dict[int, str] = {}
    for c in choices:
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    finishes = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"]}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert texts[0].startswith("one") and texts[3].startswith("two")


def test_streaming_chat_logprobs_come_with_each_delta(http: httpx.Client) -> None:
    body = dict(CHAT, max_tokens=3, stream=True, logprobs=True, top_logprobs=2, ignore_eos=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        lines = [line for line in resp.iter_lines() if line]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0] for c in chunks if c["choices"][0]["logprobs"]]
    entries = [e for d in deltas for e in d["logprobs"]["content"]]
    assert len(entries) == 3
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    assert "".join(e["token"] for e in entries) == "".join(d["delta"]["content"] for d in deltas)
