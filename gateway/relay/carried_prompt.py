"""The prompt token ids a request carries to a local engine (portico/contract.py "Carried
prompt"): admission already rendered and encoded the prompt with the served model's own
tokenizer, so the engine takes those ids rather than rendering and encoding it again.

Only where the ids are certainly the engine's: the tokenizer admission used is the one loaded
for the pool's model (:attr:`LocalUpstream.carry_tokenizer`), and the request is a chat of
plain text messages (no tools, content parts, images, tool calls or shared prefix) or a
completion with one text prompt. Everything else travels unchanged and the engine renders it.
"""

from __future__ import annotations

from typing import Any

from gateway.body.fields import RequestFields
from portico.contract import PROMPT_IDS_FIELD, prompt_ids_field

try:  # orjson writes a 300-id list in ~4 us, the standard library's join in ~35-65
    import orjson

    _KEY = b'"%s":' % PROMPT_IDS_FIELD.encode()

    def _member(token_ids: list[int]) -> bytes:
        return _KEY + orjson.dumps(token_ids)

except ImportError:  # pragma: no cover - orjson is optional
    _member = prompt_ids_field

_PLAIN_ROLES = frozenset(("system", "user", "assistant"))
_PLAIN_KEYS = frozenset(("role", "content"))


def carried_prompt_ids(tokenizer: Any, fields: RequestFields) -> list[int] | None:
    """The ids admission counted for this request, or None where they may not be the
    engine's (see the module docstring)."""
    if tokenizer is None or fields.num_tools or fields.shared_prefix is not None:
        return None
    if fields.kind == "chat":
        counted = fields.chat_prompt_ids
        if counted is None or counted[0] is not tokenizer or counted[1] is not fields.messages:
            return None
        if not all(_plain(m) for m in counted[1]):
            return None
        return counted[2]
    if fields.kind == "completion":
        encoded = fields.text_prompt_ids
        if encoded is None or encoded[0] is not tokenizer or encoded[1] is not fields.prompt:
            return None
        return encoded[2]
    return None


def _plain(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and message.keys() <= _PLAIN_KEYS
        and message.get("role") in _PLAIN_ROLES
        and isinstance(message.get("content"), str)
    )


def with_prompt_ids(body: bytes, token_ids: list[int]) -> bytes:
    """``body`` (a JSON object) with the carried ids appended as its last member: JSON's last
    duplicate key wins, so a client's own field of that name is overridden."""
    end = body.rstrip().rfind(b"}")
    return body[:end] + b"," + _member(token_ids) + b"}"
