"""PromptCounter: the served model's tokenizer in the gateway, chat template applied."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.admission.prompt_tokens import PromptCounter, load_tokenizer
from gateway.dataplane.fields import parse_fields


def test_counts_match_the_tokenizer_with_the_chat_template(tiny_llama_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_llama_dir))
    assert tok is not None
    counter = PromptCounter({"tiny": tok})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = parse_fields(json.dumps({"model": "tiny", "messages": messages}).encode(), "chat")
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert 5 < expected < 100
    assert counter.count("tiny", chat) == expected
    prompt = parse_fields(b'{"model": "tiny", "prompt": "Once upon a time"}', "completion")
    assert counter.count("tiny", prompt) == len(tok("Once upon a time")["input_ids"])
    ids = parse_fields(b'{"model": "tiny", "prompt": [1, 2, 3, 4]}', "completion")
    assert counter.count("tiny", ids) == 4


def test_models_without_a_tokenizer_are_estimated() -> None:
    counter = PromptCounter({})
    fields = parse_fields(b'{"model": "remote", "prompt": "' + b"x" * 400 + b'"}', "completion")
    assert counter.count("remote", fields) == 100
    assert load_tokenizer("/no/such/model") is None
