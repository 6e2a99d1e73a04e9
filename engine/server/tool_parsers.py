"""Tool-call parsers: a model's generated text in, content and tool calls out.

A parser is a pure function of the text generated so far: ``parse(text, final)`` returns what
that prefix says for sure (the content, and each tool call whose name is known with the raw text
of its arguments so far). It is *monotone*: what it returns for a prefix is a prefix of what it
returns for any longer text (content only grows at its end, calls are only appended, a call's
arguments only grow at their end). That one property makes streaming exact: the stream sends the
difference between two consecutive results, and the non-streamed reply is the result for the
whole text, so the streamed deltas always reassemble to exactly the non-streamed tool calls.
Re-parsing the whole text at each step costs O(length) per step; tool-call replies are short.

The arguments of a call are the raw JSON text the model wrote (not re-serialized), so a client
sees the model's bytes, and a prefix of them while streaming.

Parsers are chosen by name (``--tool-call-parser``, as in vLLM) from :data:`TOOL_PARSERS`.
:class:`JsonToolCallParser` is not in the registry: it reads the output that the grammar forces
for ``tool_choice`` ``required`` and named functions (one JSON object, or a JSON array of them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

_WHITESPACE = " \t\n\r"
_NAME_KEYS = ("name",)
_ARGUMENT_KEYS = ("arguments", "parameters")  # some Hermes-style models say "parameters"


@dataclass
class ParsedCall:
    """One tool call as far as it was generated: its name and its arguments' raw JSON text."""

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """What a prefix of the generated text holds: the content and the tool calls."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(Protocol):
    """Turns generated text into content and tool calls; see the module docstring."""

    def parse(self, text: str, final: bool) -> ParsedOutput: ...


# ---------------------------------------------------------------------- JSON scanning


def _skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index after the JSON string starting at ``text[i] == '"'``, None if it is unfinished."""
    i += 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at ``text[i]``, None if it is unfinished."""
    ch = text[i]
    if ch == '"':
        return _string_end(text, i)
    if ch in "{[":
        depth = 0
        while i < len(text):
            ch = text[i]
            if ch == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < len(text) and text[i] not in ",}]" + _WHITESPACE:
        i += 1  # a number, true, false or null: it ends at a delimiter
    return i if i < len(text) else None


@dataclass
class _ObjectScan:
    name: str | None
    arguments: str
    end: int | None  # index after the closing brace; None while unfinished


def _json_string(quoted: str) -> str | None:
    """The string a closed JSON string literal spells, or None where it is not one (a model
    can write ``"\\1"``, an escape JSON does not have)."""
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _scan_call_object(text: str, start: int) -> _ObjectScan:
    """Read the call object ``{"name": ..., "arguments": {...}}`` at ``text[start] == '{'``.

    The name counts once its string is closed; the arguments are the raw text of their value,
    up to where the text ends while it is unfinished. Keys other than these are skipped.
    """
    name: str | None = None
    arguments = ""
    i = start + 1
    while True:
        i = _skip_whitespace(text, i)
        if i >= len(text):
            return _ObjectScan(name, arguments, None)
        if text[i] == "}":
            return _ObjectScan(name, arguments, i + 1)
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return _ObjectScan(name, arguments, None)  # not JSON: nothing more is certain
        key_end = _string_end(text, i)
        if key_end is None:
            return _ObjectScan(name, arguments, None)
        key = _json_string(text[i:key_end])
        if key is None:
            return _ObjectScan(name, arguments, None)  # a bad escape: not JSON
        i = _skip_whitespace(text, key_end)
        if i >= len(text) or text[i] != ":":
            return _ObjectScan(name, arguments, None)
        i = _skip_whitespace(text, i + 1)
        if i >= len(text):
            return _ObjectScan(name, arguments, None)
        end = _value_end(text, i)
        if key in _NAME_KEYS and text[i] == '"' and end is not None and name is None:
            name = _json_string(text[i:end])
        elif key in _ARGUMENT_KEYS and not arguments:
            arguments = text[i : len(text) if end is None else end]
        if end is None:
            return _ObjectScan(name, arguments, None)
        i = end


# ---------------------------------------------------------------------- parsers


class HermesToolParser:
    """Hermes-style output: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    Text outside the blocks is the content. A block whose JSON never names a function is given
    back as content, not dropped. While generating, a tail that could still become the start tag,
    and trailing whitespace, are held back (they may turn out not to be content); a reply with
    tool calls ends its content at its last non-space character, and has no content (None, in the
    response) when nothing but whitespace surrounds the calls.
    """

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        outside: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            open_at = text.find(self.start_tag, pos)
            if open_at == -1:
                tail = text[pos:]
                outside.append(tail if final else tail[: len(tail) - self._partial_tag(tail)])
                break
            outside.append(text[pos:open_at])
            body_at = open_at + len(self.start_tag)
            close_at = text.find(self.end_tag, body_at)
            body_end = len(text) if close_at == -1 else close_at
            call = self._call_in(text[body_at:body_end])
            if call is not None:
                calls.append(call)
            elif close_at != -1 or final:
                outside.append(text[open_at : body_end + (close_at != -1) * len(self.end_tag)])
            if close_at == -1:
                break
            pos = close_at + len(self.end_tag)
        content = "".join(outside)
        if calls or not final:
            content = content.rstrip(_WHITESPACE)
        return ParsedOutput(content, calls)

    def _partial_tag(self, tail: str) -> int:
        """Length of the longest end of ``tail`` that is a proper start of the start tag."""
        for size in range(min(len(tail), len(self.start_tag) - 1), 0, -1):
            if self.start_tag.startswith(tail[-size:]):
                return size
        return 0

    @staticmethod
    def _call_in(body: str) -> ParsedCall | None:
        i = _skip_whitespace(body, 0)
        if i >= len(body) or body[i] != "{":
            return None
        scan = _scan_call_object(body, i)
        return None if scan.name is None else ParsedCall(scan.name, scan.arguments)


class JsonToolCallParser:
    """The output the grammar forces for ``required`` and named tool choices.

    One call object ``{"name": ..., "arguments": {...}}``, or (parallel calls allowed) a JSON
    array of them. There is no content, unless the reply ends without naming any function (cut
    by ``max_tokens`` before the name was complete): then the text is given back as content.
    """

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls: list[ParsedCall] = []
        i = _skip_whitespace(text, 0)
        if i < len(text) and text[i] == "[":
            i += 1
            while True:
                i = _skip_whitespace(text, i)
                if i < len(text) and text[i] == ",":
                    i += 1
                    continue
                if i >= len(text) or text[i] != "{":
                    break
                scan = _scan_call_object(text, i)
                if scan.name is not None:
                    calls.append(ParsedCall(scan.name, scan.arguments))
                if scan.end is None:
                    break
                i = scan.end
        elif i < len(text) and text[i] == "{":
            scan = _scan_call_object(text, i)
            if scan.name is not None:
                calls.append(ParsedCall(scan.name, scan.arguments))
        return ParsedOutput(text if final and not calls else "", calls)


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
}


def tool_parser(name: str) -> ToolParser:
    """The registered parser called ``name``; ``ValueError`` listing the known ones if none is."""
    factory = TOOL_PARSERS.get(name)
    if factory is None:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})")
    return factory()
