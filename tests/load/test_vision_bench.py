"""The vision benchmark's model folders: a LLaVA transformers reads as the bench says (SmolLM2's
decoder, CLIP ViT-B/16 at 224 pixels: 196 image tokens), its tokenizer's ``<image>`` is the
config's image token, and its chat template puts the picture before the text; a Qwen2-VL
(the same decoder with M-RoPE, Qwen2-VL's tower) whose pictures count by their size."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from load.vision_bench import table, write_llava_folder, write_qwen2_vl_folder
from portico.registry import DEFAULT_MODEL, resolve, tokenizer_folder


@pytest.fixture(scope="module")
def decoder() -> Path:
    """The default model's folder (its config.json and tokenizer): the benches' decoder."""
    folder = tokenizer_folder(resolve(DEFAULT_MODEL))
    if folder is None:
        pytest.skip("the default model is not pulled (make test pulls it)")
    return folder


def test_llava_folder_has_the_benchmarked_shape(tmp_path: Path, decoder: Path) -> None:
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

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


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_qwen2_vl_folder_has_the_benchmarked_shape(
    tmp_path: Path, decoder: Path, version: str
) -> None:
    """Qwen2-VL's tower (``version`` "2") or Qwen2.5-VL's ("2.5", windowed) before the small
    decoder, as transformers and the engine read the folder."""
    import json

    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    from engine.model_config import ModelConfig
    from engine.models.qwen2_5_vl import Qwen25VLVisionConfig
    from engine.models.qwen2_vl import Qwen2VLVisionConfig
    from portico.contract import QWEN2_VL_MAX_PIXELS, QWEN2_VL_MIN_PIXELS, qwen2_vl_image_tokens

    folder = write_qwen2_vl_folder(tmp_path / "qwen2-vl", decoder, version)
    config = AutoConfig.from_pretrained(str(folder))
    assert config.model_type == {"2": "qwen2_vl", "2.5": "qwen2_5_vl"}[version]
    assert config.text_config.hidden_size == 576 and config.text_config.num_hidden_layers == 30
    width = "embed_dim" if version == "2" else "hidden_size"
    assert (config.vision_config.depth, getattr(config.vision_config, width)) == (32, 1280)
    raw = json.loads((folder / "config.json").read_text())
    ours = ModelConfig.from_hf(raw)
    read = Qwen2VLVisionConfig if version == "2" else Qwen25VLVisionConfig
    vision = read.from_multimodal(ours.multimodal or {})
    assert vision.mrope_section == (8, 12, 12) and vision.out_dim == 576
    assert (vision.depth, vision.embed_dim, vision.num_heads) == (32, 1280, 16)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    assert ours.vocab_size == len(tokenizer)
    processor = AutoImageProcessor.from_pretrained(str(folder))
    for side, tokens in ((112, 16), (224, 64)):
        made = processor(images=[Image.new("RGB", (side, side))], return_tensors="pt")
        assert int(made["image_grid_thw"][0].prod()) // 4 == tokens
        count = qwen2_vl_image_tokens(raw, side, side, QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS)
        assert count == tokens
    if isinstance(vision, Qwen25VLVisionConfig):
        assert (vision.window_size, vision.intermediate_size) == (112, 3420)
        assert vision.fullatt_block_indexes == (7, 15, 23, 31)
        assert config.vision_config.out_hidden_size == 576


def test_table_has_one_line_per_row() -> None:
    row = {
        "images": 1, "picture_px": "224", "concurrency": 4, "prompt_tokens_mean": 229.0,
        "ttft_p50_ms": 400.0, "ttft_p90_ms": 900.0, "tpot_p50_ms": 80.25, "output_tok_s": 20.0,
        "requests_s": 0.5,
    }  # fmt: skip
    lines = table({"rows": [row, dict(row, images=0)]}).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| 1 | 224 | 4 | 229.0 | 400 ms | 900 ms | 80.2 ms | 20.0 | 0.50 |"
