"""Incremental detokenization with SmolLM2's real tokenizer: multibyte characters split over
tokens, stop strings split over tokens, special tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Append ids one by one; return the visible text after each token."""
    seen = []
    for token in ids:
        detok.append(token)
        seen.append(detok.visible_text(finished=detok.stop_reason is not None))
    return seen


def test_multibyte_characters_split_across_tokens_are_never_emitted_broken(
    tokenizer: Any,
) -> None:
    text = "héllo 😀 世界 wörld 🎉!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The premise: some single tokens decode to half a character.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    seen = feed(detok, ids)
    assert all("\ufffd" not in s for s in seen)
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:], strict=False))
    assert detok.text == text


def test_text_is_held_until_the_character_completes(tokenizer: Any) -> None:
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [1])
    for token in ids[:-1]:
        detok.append(token)
        assert detok.text == ""
    detok.append(ids[-1])
    assert detok.text == "😀"


def test_flush_keeps_a_trailing_incomplete_character(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1])
    for token in ids[:-1]:
        detok.append(token)
    assert detok.text == "ok"
    detok.flush()
    assert detok.text.startswith("ok ") and detok.text.endswith("\ufffd")


def test_stop_string_split_across_tokens_is_found_and_excluded(tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "fox jum"  # spans " fox" and " jumps"
    detok = IncrementalDetokenizer(tokenizer, [1], stop=[stop])
    seen = feed(detok, ids)
    assert detok.stop_reason == stop
    assert detok.text == "The quick brown "
    # Nothing of the stop string was ever shown, and the stream only grew.
    assert all("f" not in s for s in seen)
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:], strict=False))


def test_stop_string_included_when_asked(tokenizer: Any) -> None:
    ids = tokenizer.encode("The quick brown fox jumps over", add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer, [1], stop=["own fo", "lazy"], include_stop_str_in_output=True
    )
    feed(detok, ids)
    assert detok.stop_reason == "own fo"
    assert detok.text == "The quick brown fo"


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["gamma", "beta gam"])
    feed(detok, ids)
    assert detok.stop_reason == "beta gam"
    assert detok.text == "alpha "


def test_multibyte_stop_string(tokenizer: Any) -> None:
    ids = tokenizer.encode("你好世界再见", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["世界"])
    feed(detok, ids)
    assert detok.stop_reason == "世界"
    assert detok.text == "你好"


def test_skip_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>", add_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    feed(skipped, ids)
    feed(kept, ids)
    assert skipped.text == "assistant\nHi"
    assert kept.text == "<|im_start|>assistant\nHi<|im_end|>"


def test_a_token_recorded_without_text_adds_nothing(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1])
    feed(detok, ids)
    detok.append(ids[0], decode=False)
    assert detok.text == "Hello world"


def test_leading_space_after_the_prompt_is_kept(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    ids = tokenizer.encode(" there, world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    feed(detok, ids)
    assert detok.text == " there, world"
