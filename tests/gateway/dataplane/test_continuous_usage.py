"""Usage on every chunk of a local engine's stream: the gateway reads it (so a stream cut short
is charged what it generated) and gives the client exactly the usage it asked for."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

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


# The rule event by event, as the relay applied it before it went over a block by offsets
# (issue 44, session 18): the one-pass version must give the same bytes and the same usage.
def _event_by_event(block: bytes, usage: Usage, view: UsageView) -> bytes:
    out = []
    for event in block.split(b"\n\n"):
        if not event:
            continue
        at = event.rfind(b',"usage":{')
        if at < 0:
            at = event.rfind(b', "usage": {')
        if at < 0 or event[-1:] != b"}" or not event.startswith(b"data: {"):
            out.append(event + b"\n\n")
            continue
        usage.pending, usage.pending_at = event, at
        head = event[:at]
        if view.every_chunk:
            out.append(event + b"\n\n")
        elif head.endswith((b'"choices":[]', b'"choices": []')):
            out.append(event + b"\n\n" if view.final else b"")
        else:
            out.append(head + b',"usage":null}\n\n')
    return b"".join(out)


_PIECES = [
    _chunk("a", 1)[:-2],
    _chunk("", 2, final=True)[:-2],
    b'data: {"id":"c", "choices": [], "usage": {"prompt_tokens": 9}}',  # spaced, usage-only
    b'data: {"id":"c","choices":[{"delta":{"content":"x"}}], "usage": {"prompt_tokens": 3}}',
    b"data: [DONE]",
    b": keep-alive",
    b'data: {"usage":{"prompt_tokens":1}',  # cut short: no closing brace
    b'event: x\ndata: {"a":1,"usage":{"b":2}}',
    b"",
    b"\n",
    b"}",
]


@given(
    pieces=st.lists(st.sampled_from(_PIECES), max_size=8),
    separators=st.lists(st.sampled_from([b"\n\n", b"\n\n\n", b"\n", b""]), min_size=8, max_size=8),
    final=st.booleans(),
    every_chunk=st.booleans(),
)
def test_one_pass_over_a_block_matches_the_rule_event_by_event(
    pieces: list[bytes], separators: list[bytes], final: bool, every_chunk: bool
) -> None:
    block = b"".join(p + s for p, s in zip(pieces, separators, strict=False))
    view = UsageView(final=final, every_chunk=every_chunk, continuous=True)
    mine, theirs = Usage(), Usage()
    assert _take_usage(block, mine, view) == _event_by_event(block, theirs, view)
    assert (mine.pending, mine.pending_at) == (theirs.pending, theirs.pending_at)
