"""Usage on every chunk of a local engine's stream: the gateway reads it (so a stream cut short
is charged what it generated) and gives the client exactly the usage it asked for."""

from __future__ import annotations

import json

from gateway.body.fields import parse_fields
from gateway.relay.usage_relay import Usage, UsageView, _take_usage, upstream_body, usage_view


def _chunk(text: str, completion: int, final: bool = False) -> bytes:
    usage = {"prompt_tokens": 9, "completion_tokens": completion, "total_tokens": 9 + completion}
    choices = [] if final else [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    body = {"id": "c", "object": "chat.completion.chunk", "choices": choices, "usage": usage}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


STREAM = _chunk("a", 1) + _chunk("b", 2) + _chunk("", 2, final=True) + b"data: [DONE]\n\n"


def _events(block: bytes) -> list[dict[str, object]]:
    return [json.loads(e[6:]) for e in block.split(b"\n\n") if e.startswith(b"data: {")]


def test_a_client_that_asked_no_usage_sees_null_usage_and_no_usage_event() -> None:
    usage = Usage()
    out = _take_usage(STREAM, usage, UsageView(continuous=True))
    usage.resolve()  # what closing the stream does: one parse, of the latest usage
    events = _events(out)
    assert [e["usage"] for e in events] == [None, None]
    assert out.endswith(b"data: [DONE]\n\n")
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (9, 2, True)


def test_usage_so_far_is_known_after_any_chunk() -> None:
    usage = Usage()
    _take_usage(_chunk("a", 1), usage, UsageView(continuous=True))
    assert not usage.reported  # nothing parsed per chunk
    usage.resolve()
    assert (usage.prompt_tokens, usage.completion_tokens) == (9, 1)
    usage.resolve()  # idempotent
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (9, 1, True)


def test_include_usage_keeps_the_final_event_only() -> None:
    usage = Usage()
    events = _events(_take_usage(STREAM, usage, UsageView(final=True, continuous=True)))
    assert [e["usage"] for e in events[:2]] == [None, None]
    assert events[2]["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}


def test_continuous_usage_asked_by_the_client_passes_unchanged() -> None:
    assert _take_usage(STREAM, Usage(), UsageView(True, True, True)) == STREAM


def test_the_engine_hop_asks_for_usage_on_every_chunk() -> None:
    raw = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "x"}]}'
    fields = parse_fields(raw, "chat")
    body = json.loads(upstream_body(raw, fields, "m", "s", None, local_engine=True))
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert usage_view(fields, True) == UsageView(False, False, True)
    raw = (
        b'{"model": "m", "stream": true, "stream_options": {"include_usage": true},'
        b' "messages": [{"role": "user", "content": "x"}]}'
    )
    fields = parse_fields(raw, "chat")
    body = json.loads(upstream_body(raw, fields, "m", "s", None, local_engine=True))
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert usage_view(fields, True) == UsageView(True, False, True)


def test_usage_written_with_spaces_is_read_too() -> None:
    spaced = STREAM.replace(b'":', b'": ').replace(b'","', b'", "').replace(b',"usage', b', "usage')
    usage = Usage()
    events = _events(_take_usage(spaced, usage, UsageView(continuous=True)))
    usage.resolve()
    assert [e["usage"] for e in events] == [None, None]
    assert (usage.prompt_tokens, usage.completion_tokens) == (9, 2)


def test_a_responses_stream_is_read_as_before() -> None:
    raw = b'{"model": "m", "stream": true, "input": "hi"}'
    fields = parse_fields(raw, "responses")
    view = usage_view(fields, True)
    assert not view.continuous
    done = (
        b"event: response.completed\n"
        b'data: {"type":"response.completed","response":{"id":"r","usage":'
        b'{"input_tokens":4,"output_tokens":2}}}\n\n'
    )
    usage = Usage()
    assert _take_usage(done, usage, view) == done
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 2)
    # an event that is not a data line is never rewritten, even on a continuous stream
    assert _take_usage(done, Usage(), UsageView(continuous=True)) == done
