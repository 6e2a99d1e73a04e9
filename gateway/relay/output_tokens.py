"""Counting the completion tokens of an answer whose upstream reported no usage.

Settlement needs the real output size. Engines always report it, and so do OpenAI-compatible
providers asked for ``stream_options.include_usage``; some (older Azure API versions, some
self-hosted servers) send a stream without it. Then the gateway counts the output text itself:
with the model's tokenizer when it has one (``source = "tokenizer"``), else by OpenAI's
documented rule of thumb, one token per ~4 characters of English text, rounded up
(``source = "estimate"``). The output text is every choice's ``message.content`` /
``delta.content`` / ``text`` / ``reasoning_content`` and its tool calls' names and arguments.
The prompt side needs no counting: admission already counted it.
"""

from __future__ import annotations

import json
from typing import Any

CHARS_PER_TOKEN = 4  # https://help.openai.com/en/articles/4936856 ("1 token ~= 4 chars")

try:
    import orjson

    _loads: Any = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads


class OutputCounter:
    """Counts output tokens from answer bytes; ``source`` names the rule it uses.

    ``tokenizer`` is anything with ``encode(text, add_special_tokens=False)`` (a
    ``transformers`` tokenizer, as :func:`gateway.admission.prompt_tokens.load_tokenizer`
    returns), or None for the estimate.
    """

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = "tokenizer" if tokenizer is not None else "estimate"

    def count_text(self, text: str) -> int:
        if not text:
            return 0
        tok = self.tokenizer
        if tok is not None:
            backend = getattr(tok, "backend_tokenizer", None)  # the fast path, as for prompts
            if backend is not None:
                return len(backend.encode(text, add_special_tokens=False).ids)
            return len(tok.encode(text, add_special_tokens=False))
        return -(-len(text) // CHARS_PER_TOKEN)

    def count_body(self, body: bytes) -> int:
        """A whole (non-streamed) completion's output tokens."""
        try:
            data = _loads(body)
        except ValueError:
            return 0
        parts: list[str] = []
        if isinstance(data, dict):
            for choice in data.get("choices") or ():
                if isinstance(choice, dict):
                    _collect(choice.get("message") or choice, parts)
        return self.count_text("".join(parts))

    def count_stream(self, blocks: list[bytes]) -> int:
        """A stream's output tokens, from its SSE events (blocks of whole events)."""
        parts: list[str] = []
        for block in blocks:
            for event in block.split(b"\n\n"):
                start = event.find(b"data: {")
                if start < 0:
                    continue
                try:
                    data = _loads(event[start + 6 :])
                except ValueError:
                    continue
                if not isinstance(data, dict):
                    continue
                for choice in data.get("choices") or ():
                    if isinstance(choice, dict):
                        _collect(choice.get("delta") or choice, parts)
        return self.count_text("".join(parts))


def _collect(part: Any, out: list[str]) -> None:
    """The generated text of one message, delta or legacy completion choice."""
    if not isinstance(part, dict):
        return
    for key in ("content", "text", "reasoning_content", "refusal"):
        value = part.get(key)
        if isinstance(value, str):
            out.append(value)
    for call in part.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                value = function.get(key)
                if isinstance(value, str):
                    out.append(value)
