"""Prompt token counts for admission, with the served model's own tokenizer.

One tokenizer per local model, loaded once at start-up (transformers ``AutoTokenizer`` from the
model folder or GGUF file); chat requests are rendered with the model's chat template first,
exactly as the engine renders them. Counting in-process costs tens of microseconds for a short
prompt, an HTTP hop to the engine's ``/tokenize`` costs a round trip plus the engine's own
parse, so the gateway counts itself. Models without a local tokenizer (remote upstreams, custom
engine commands) get an estimate of one token per four characters. Tool definitions are part of
the prompt the engine renders (a listing of each function's JSON schema), so their JSON text is
counted too, whether or not the model's template shows them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from gateway.body.fields import RequestFields, prompt_text

log = logging.getLogger("portico.gateway.tokens")


def load_tokenizer(model: str) -> Any | None:
    """The tokenizer of a model spec (alias, HF folder or GGUF path), or None if unavailable."""
    try:
        from transformers import AutoTokenizer

        from portico import registry

        source = registry.resolve(model)
        folder = registry.tokenizer_folder(source)  # written by `portico models pull`
        if folder is not None:
            return AutoTokenizer.from_pretrained(str(folder))
        if source.format == "gguf":
            return AutoTokenizer.from_pretrained(
                str(source.path.parent), gguf_file=source.path.name
            )
        return AutoTokenizer.from_pretrained(str(source.path))
    except Exception as exc:  # any failure means: estimate instead
        log.warning("no tokenizer for %s (%s); prompt tokens will be estimated", model, exc)
        return None


class PromptCounter:
    """Counts prompt tokens per served model name; thread-compatible, no shared mutation."""

    def __init__(self, tokenizers: dict[str, Any]) -> None:
        self.tokenizers = tokenizers  # served model name -> tokenizer (absent: estimate)

    def count(self, model: str, fields: RequestFields) -> int:
        tools = (
            (fields.body.get("tools") or fields.body.get("functions")) if fields.num_tools else []
        )
        tool_text = json.dumps(tools) if tools else ""
        tok = self.tokenizers.get(model)
        if tok is not None:
            try:
                return self._exact(tok, fields) + self._text_tokens(tok, tool_text)
            except Exception:  # a template that rejects these messages: the engine will say why
                pass
        return max(1, (len(prompt_text(fields)) + len(tool_text)) // 4)

    @staticmethod
    def _text_tokens(tok: Any, text: str) -> int:
        if not text:
            return 0
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            return len(backend.encode(text, add_special_tokens=False).ids)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _exact(tok: Any, fields: RequestFields) -> int:
        # The Rust tokenizer underneath a fast tokenizer skips transformers' per-call Python
        # work (BatchEncoding, argument checks): about half the cost for a short prompt.
        backend = getattr(tok, "backend_tokenizer", None)
        if fields.messages is not None:
            text = tok.apply_chat_template(
                fields.messages, tokenize=False, add_generation_prompt=True
            )
            if backend is not None:
                ids = list(backend.encode(text, add_special_tokens=False).ids)
            else:
                ids = list(tok(text, add_special_tokens=False)["input_ids"])
            # kept for the prefix-aware router: the same rendering, the same encoding
            fields.chat_prompt_ids = (tok, fields.messages, ids)
            return len(ids)
        prompt = fields.prompt
        if isinstance(prompt, str):
            if backend is not None:
                return len(backend.encode(prompt).ids)
            return len(tok(prompt)["input_ids"])
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)  # already token ids
        total = 0
        for item in prompt or ():
            if isinstance(item, str):
                total += len(tok(item)["input_ids"])
            elif isinstance(item, list):
                total += len(item)
        return total
