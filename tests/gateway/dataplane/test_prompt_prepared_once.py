"""A chat prompt is rendered once in the gateway: admission's exact count keeps the token ids it
made, and the prefix-aware router hashes those same ids instead of rendering the chat template
a second time; ids made by another tokenizer, or for messages the long-prompt policy has since
replaced, are never reused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.admission.prompt_tokens import PromptCounter, load_tokenizer
from gateway.body.fields import RequestFields, parse_fields
from gateway.fleet.prefix_index import route_token_ids

MESSAGES = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Which river runs through the old town, and how long is it?"},
]


class CountingTokenizer:
    """The real tokenizer, counting how often a chat template is rendered through it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.renders = 0

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.renders += 1
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def chat_fields(messages: list[dict[str, str]]) -> RequestFields:
    return parse_fields(json.dumps({"model": "m", "messages": messages}).encode(), "chat")


def test_the_router_reuses_the_ids_admission_counted(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    assert tokenizer is not None and getattr(tokenizer, "chat_template", None)
    counting = CountingTokenizer(tokenizer)
    fields = chat_fields(MESSAGES)
    num_tokens = PromptCounter({"m": counting}).count("m", fields)
    ids = route_token_ids(counting, fields)
    assert counting.renders == 1
    # the same ids the router computes on its own from a fresh parse of the same body
    assert ids == route_token_ids(tokenizer, chat_fields(MESSAGES))
    assert ids is not None and len(ids) == num_tokens


def test_ids_of_another_tokenizer_or_of_replaced_messages_are_not_reused(
    tiny_llama_dir: Path,
) -> None:
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    assert tokenizer is not None
    counting = CountingTokenizer(tokenizer)
    fields = chat_fields(MESSAGES)
    PromptCounter({"m": tokenizer}).count("m", fields)
    route_token_ids(counting, fields)  # another tokenizer object: renders its own
    assert counting.renders == 1
    shorter = MESSAGES[1:]
    fields.messages = shorter  # what the long-prompt policy does before it counts again
    assert route_token_ids(counting, fields) == route_token_ids(tokenizer, chat_fields(shorter))
    assert counting.renders == 2
