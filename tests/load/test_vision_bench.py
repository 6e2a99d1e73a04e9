"""The vision benchmark's model folder: a LLaVA transformers reads as the bench says (SmolLM2's
decoder, CLIP ViT-B/16 at 224 pixels: 196 image tokens), its tokenizer's ``<image>`` is the
config's image token, and its chat template puts the picture before the text."""

from __future__ import annotations

from pathlib import Path

import pytest

from load.vision_bench import table, write_llava_folder
from portico.registry import DEFAULT_MODEL, resolve, tokenizer_folder


def test_llava_folder_has_the_benchmarked_shape(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    decoder = tokenizer_folder(resolve(DEFAULT_MODEL))
    if decoder is None:
        pytest.skip("the default model is not pulled (make test pulls it)")
    folder = write_llava_folder(tmp_path / "llava", decoder)
    config = AutoConfig.from_pretrained(str(folder))
    assert config.model_type == "llava"
    assert config.text_config.hidden_size == 576 and config.text_config.num_hidden_layers == 30
    vision = config.vision_config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.patch_size) == (768, 12, 16)
    assert config.image_seq_length == (224 // 16) ** 2 == 196
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.convert_tokens_to_ids("<image>") == config.image_token_index
    assert config.text_config.vocab_size == len(tokenizer)
    parts = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "USER: <image>\nWhat is it? ASSISTANT:"
    processor = AutoImageProcessor.from_pretrained(str(folder))
    assert processor.crop_size == {"height": 224, "width": 224}


def test_table_has_one_line_per_row() -> None:
    row = {
        "images": 1, "concurrency": 4, "prompt_tokens_mean": 229.0, "ttft_p50_ms": 400.0,
        "ttft_p90_ms": 900.0, "tpot_p50_ms": 80.25, "output_tok_s": 20.0, "requests_s": 0.5,
    }  # fmt: skip
    lines = table({"rows": [row, dict(row, images=0)]}).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| 1 | 4 | 229.0 | 400 ms | 900 ms | 80.2 ms | 20.0 | 0.50 |"
