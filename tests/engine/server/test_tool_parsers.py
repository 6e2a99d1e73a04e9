"""Tool-call parsers and the streamed deltas built on them (pure: no engine needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.server.tool_calling import ToolCallDeltas, reply_message
from engine.server.tool_parsers import (
    HermesToolParser,
    JsonToolCallParser,
    ParsedCall,
    ToolParser,
    tool_parser,
)

WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
TIME = '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris \\"CET\\""}}</tool_call>'


def reassemble(parser: ToolParser, pieces: list[str]) -> dict[str, Any]:
    """Feed ``pieces`` as a stream would and put the deltas back together, as the SDKs do."""
    deltas = ToolCallDeltas(parser)
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    text = ""
    for number, piece in enumerate(pieces):
        text += piece
        new_content, call_deltas = deltas.update(text, final=number == len(pieces) - 1)
        content += new_content
        for delta in call_deltas:
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["type"] == "function"
                calls[delta["index"]] = {"name": delta["function"]["name"], "arguments": ""}
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {
                    "arguments"
                }
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}


def whole(parser: ToolParser, text: str) -> dict[str, Any]:
    parsed = parser.parse(text, final=True)
    return {
        "content": parsed.content,
        "calls": [{"name": c.name, "arguments": c.arguments} for c in parsed.calls],
    }


def test_hermes_reads_each_block_and_keeps_the_arguments_text() -> None:
    parsed = HermesToolParser().parse(f"Let me check.\n{WEATHER}\n{TIME}\n", final=True)
    assert parsed.content == "Let me check."
    assert parsed.calls == [
        ParsedCall("get_weather", '{"city": "Paris", "days": 3}'),
        ParsedCall("get_time", '{"tz": "Europe/Paris \\"CET\\""}'),
    ]
    assert json.loads(parsed.calls[1].arguments) == {"tz": 'Europe/Paris "CET"'}


def test_hermes_without_calls_returns_the_text_unchanged() -> None:
    text = "  no tools needed here <tool_ \n"
    assert HermesToolParser().parse(text, final=True).content == text


def test_hermes_gives_a_block_without_a_name_back_as_content() -> None:
    parsed = HermesToolParser().parse("Hi <tool_call>not json</tool_call> there", final=True)
    assert parsed.calls == []
    assert parsed.content == "Hi <tool_call>not json</tool_call> there"


def test_hermes_accepts_parameters_and_an_unclosed_last_block() -> None:
    text = '<tool_call>{"parameters": {"q": "x"}, "name": "search"}'
    assert HermesToolParser().parse(text, final=True).calls == [ParsedCall("search", '{"q": "x"}')]


def test_hermes_holds_back_what_may_become_a_tag() -> None:
    parser = HermesToolParser()
    assert parser.parse("Sure <tool_", final=False).content == "Sure"
    assert parser.parse("Sure <tool_", final=True).content == "Sure <tool_"


def test_json_parser_reads_one_call_or_an_array() -> None:
    parser = JsonToolCallParser()
    one = parser.parse('{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}', final=True)
    assert one.calls == [ParsedCall("f", '{"a": [1, {"b": "}"}]}')] and one.content == ""
    many = parser.parse(
        '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": 1}}]', True
    )
    assert many.calls == [ParsedCall("f", "{}"), ParsedCall("g", '{"x": 1}')]


def test_json_parser_gives_back_text_that_names_no_function() -> None:
    assert JsonToolCallParser().parse('{"na', final=True).content == '{"na'


def test_a_reply_with_calls_and_no_text_has_null_content() -> None:
    parsed = HermesToolParser().parse(f"\n{WEATHER}\n", final=True)
    message = reply_message(parsed, ["call_1"])
    assert message["content"] is None
    assert message["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
    }


def test_the_registry_names_its_parsers() -> None:
    assert isinstance(tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")


def test_the_first_delta_of_a_call_carries_id_type_and_name_once() -> None:
    deltas = ToolCallDeltas(JsonToolCallParser())
    _, first = deltas.update('{"name": "f", "arguments": {"a"', final=False)
    _, second = deltas.update('{"name": "f", "arguments": {"a": 1}}', final=True)
    assert first == [
        {
            "index": 0,
            "id": deltas.call_ids[0],
            "type": "function",
            "function": {"name": "f", "arguments": '{"a"'},
        }
    ]
    assert second == [{"index": 0, "function": {"arguments": ": 1}"}}]


SAMPLES = [
    f"Let me check.\n{WEATHER}\n{TIME}\n",
    f"{WEATHER}{TIME}",
    "Plain text with a < sign and <tool_ but no call.",
    "Hi <tool_call>not json</tool_call> there",
    '<tool_call>{"arguments": {"q": "a\\\\"}, "name": "search"}</tool_call> done',
    '<tool_call>{"name": "f", "arguments": {"n": 12',
]
JSON_SAMPLES = [
    '{"name": "f", "arguments": {"a": [1, {"b": "}"}], "c": -2.5e3}}',
    '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": true}}]',
    '  [ {"arguments": {"x": null}, "name": "g"} ]',
    '{"name": "f", "argu',
]


def splits(text: str) -> st.SearchStrategy[list[str]]:
    cuts = st.lists(st.integers(min_value=1, max_value=max(1, len(text) - 1)), max_size=12)
    return cuts.map(lambda points: pieces_at(text, sorted(set(points))))


def pieces_at(text: str, points: list[int]) -> list[str]:
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@given(st.sampled_from(SAMPLES).flatmap(lambda t: st.tuples(st.just(t), splits(t))))
def test_hermes_stream_reassembles_to_the_whole_parse(sample: tuple[str, list[str]]) -> None:
    text, pieces = sample
    assert reassemble(HermesToolParser(), pieces) == whole(HermesToolParser(), text)


@given(st.sampled_from(JSON_SAMPLES).flatmap(lambda t: st.tuples(st.just(t), splits(t))))
def test_json_stream_reassembles_to_the_whole_parse(sample: tuple[str, list[str]]) -> None:
    text, pieces = sample
    assert reassemble(JsonToolCallParser(), pieces) == whole(JsonToolCallParser(), text)


@given(st.text(alphabet='<>/_toolcaln{}[]":, \\ab1', max_size=60), st.data())
def test_any_text_streams_to_its_whole_parse(text: str, data: st.DataObject) -> None:
    pieces = data.draw(splits(text)) if text else [""]
    for parser in (HermesToolParser(), JsonToolCallParser()):
        assert reassemble(parser, pieces) == whole(parser, text)


def test_a_string_with_an_escape_json_lacks_ends_the_call_instead_of_failing() -> None:
    """Hypothesis found ``{"\\1"``: a key (or a name) whose escape JSON does not have is not a
    call, streamed or whole, and the stream goes on as text."""
    for text in ('{"\\1"', '{"name": "\\q", "arguments": {}}', '<tool_call>{"\\1": 2}'):
        for parser in (HermesToolParser(), JsonToolCallParser()):
            assert reassemble(parser, [text[:3], text[3:]]) == whole(parser, text)
