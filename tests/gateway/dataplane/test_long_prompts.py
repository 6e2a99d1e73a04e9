"""The long-prompt policies (gateway/relay/long_prompts.py) with the tiny Llama's real
tokenizer and chat template: what is cut, what is kept, and the counts after the cut."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.admission.prompt_tokens import PromptCounter, load_tokenizer
from gateway.body.fields import parse_fields
from gateway.relay.long_prompts import PromptFit, context_length

LIMIT = 200


@pytest.fixture(scope="module")
def counter(tiny_llama_dir: Path) -> PromptCounter:
    return PromptCounter({"tiny": load_tokenizer(str(tiny_llama_dir))})


def chat(turns: int) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"turn {i}: " + "words " * 20})
    return messages


def fields_of(body: dict[str, Any], kind: str = "chat") -> Any:
    import json

    return parse_fields(json.dumps(body).encode(), kind)


@pytest.mark.parametrize("policy", ["truncate_left", "truncate_middle"])
def test_a_long_conversation_is_cut_to_fit_keeping_system_and_last_turn(
    counter: PromptCounter, policy: str
) -> None:
    fields = fields_of({"model": "tiny", "messages": chat(15), "max_tokens": 20})
    before = counter.count("tiny", fields)
    assert before > LIMIT
    fit = PromptFit(LIMIT, policy)  # type: ignore[arg-type]
    after, header = fit.apply(fields, before, counter, "tiny")
    assert header is not None and header.startswith(policy)
    assert after + 20 <= LIMIT and after == counter.count("tiny", fields)
    kept = fields.body["messages"]
    assert kept[0]["role"] == "system" and kept[-1]["content"].startswith("turn 14")
    if policy == "truncate_middle":
        assert kept[1]["content"].startswith("turn 0")  # the first turn stays
    else:
        assert not any(m["content"].startswith("turn 0") for m in kept)
    assert fields.edited


def test_refuse_and_fitting_prompts_are_left_alone(counter: PromptCounter) -> None:
    fields = fields_of({"model": "tiny", "messages": chat(15)})
    n = counter.count("tiny", fields)
    assert PromptFit(LIMIT, "refuse").apply(fields, n, counter, "tiny") == (n, None)
    short = fields_of({"model": "tiny", "messages": chat(1)})
    m = counter.count("tiny", short)
    assert PromptFit(LIMIT, "truncate_left").apply(short, m, counter, "tiny") == (m, None)


def test_text_prompts_keep_their_tail_or_head_and_tail(counter: PromptCounter) -> None:
    text = " ".join(f"w{i}" for i in range(400))
    left = fields_of({"model": "tiny", "prompt": text, "max_tokens": 10}, "completion")
    n = counter.count("tiny", left)
    after, header = PromptFit(LIMIT, "truncate_left").apply(left, n, counter, "tiny")
    assert left.body["truncate_prompt_tokens"] == after == LIMIT - 10 and header
    middle = fields_of({"model": "tiny", "prompt": text, "max_tokens": 10}, "completion")
    after, header = PromptFit(LIMIT, "truncate_middle").apply(middle, n, counter, "tiny")
    ids = counter.tokenizers["tiny"].encode(text)
    kept = middle.body["prompt"]
    assert after == len(kept) == LIMIT - 10 and header
    assert kept[:5] == ids[:5] and kept[-5:] == ids[-5:]


def test_max_tokens_the_gateway_chose_is_cut_to_what_fits() -> None:
    fit = PromptFit(1024)
    assert fit.cap_max_tokens(1000, 4096) is None  # the engine's "as much as fits"
    assert fit.cap_max_tokens(10, 100) == 100


def test_context_length_from_the_flag_or_the_model_folder(tiny_llama_dir: Path) -> None:
    assert context_length("x", ["--max-model-len", "512"]) == 512
    assert context_length("x", ["--max-model-len=256"]) == 256
    assert context_length(str(tiny_llama_dir), []) == 1024
    assert context_length("/no/such/model", []) is None
