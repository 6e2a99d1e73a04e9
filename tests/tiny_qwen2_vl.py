"""A tiny random Qwen2-VL (or Qwen2.5-VL) for tests, as a real Hugging Face folder.

A 2-layer Qwen2-VL vision tower (patch 14, temporal patch 2, 2x2 merger) and a 2-layer Qwen2
text model with M-RoPE (``mrope_section`` [2, 3, 3] over a head of 16), saved with
transformers' ``save_pretrained`` together with a ``Qwen2VLProcessor`` (its image processor,
SmolLM2's tokenizer with Qwen2-VL's vision tokens added, and a Qwen2-VL style chat template).
``version="2.5"`` builds a Qwen2.5-VL instead: the same decoder and processor, its vision
tower with RMSNorm, a SwiGLU MLP and window attention (windows of 2x2 merged cells, block 0
windowed and block 1 over the whole image), so pictures of 4 to 24 tokens span several
windows, some of them cut short at the grid's edge.
Importable by any test (``from tiny_qwen2_vl import build_tiny_qwen2_vl``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_llama import _load_real_tokenizer

from load.vision_bench import QWEN2_VL_CHAT_TEMPLATE

MIN_PIXELS = 28 * 28 * 2
MAX_PIXELS = 28 * 28 * 24  # at most 24 image tokens per image: small steps in tests
# Qwen2-VL-Instruct's template without its default system turn (the vision bench's).
CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE


def build_tiny_qwen2_vl(folder: Path, seed: int = 0, version: str = "2") -> Path:
    """Write a random Qwen2-VL (``version`` "2") or Qwen2.5-VL ("2.5") (config, safetensors,
    processor files) to ``folder``."""
    import torch
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    tokenizer = _load_real_tokenizer()
    target = folder / "_tokenizer_src"
    tokenizer.save_pretrained(str(target))
    tokenizer = tokenizer.__class__.from_pretrained(str(target))
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
            ]
        }
    )  # fmt: skip
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>")}
    text = {
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
        },
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
    }  # fmt: skip
    vision: dict[str, Any] = {
        "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2,
        "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
    }  # fmt: skip
    prefix = "Qwen2VL"
    if version == "2.5":  # the tower's width is hidden_size, the decoder's out_hidden_size
        prefix = "Qwen2_5_VL"
        vision = {
            "depth": 2, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 48,
            "num_heads": 4, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
            "window_size": 56, "fullatt_block_indexes": [1],
        }  # fmt: skip
    config = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3 if "embed_tokens" in name else 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    images = Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=14,
        temporal_patch_size=2, merge_size=2,
    )  # fmt: skip
    # No video processor (it needs torchvision, which is not installed): the image processor
    # and the tokenizer (with the template) are saved apart; reference_processor joins them.
    images.save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def reference_model(folder: Path) -> Any:
    """transformers' own model for the folder (``Qwen2VLForConditionalGeneration`` or
    ``Qwen2_5_VLForConditionalGeneration``, as its config.json names), in eval mode."""
    import json

    import transformers

    [architecture] = json.loads((folder / "config.json").read_text())["architectures"]
    return getattr(transformers, architecture).from_pretrained(str(folder)).eval()


def reference_inputs(
    folder: Path, conversation: list[Any], images: list[Any], options: Any = None
) -> dict[str, Any]:
    """What transformers' ``Qwen2VLProcessor`` hands ``generate`` for this conversation
    (its class cannot be built here: it insists on a video processor, which needs the absent
    torchvision), made with its own steps: the template rendered by the folder's tokenizer,
    ``options`` (a request's mm_processor_kwargs) over the pixel bounds,
    each ``<|image_pad|>`` repeated ``grid.prod() // merge**2`` times (the processor's
    ``replace_image_token``), the pixels and grids from the folder's image processor, and
    ``mm_token_type_ids`` marking the image tokens."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    out: dict[str, Any] = {}
    if images:
        options = options or {}
        size = {
            "shortest_edge": options.get("min_pixels") or MIN_PIXELS,
            "longest_edge": options.get("max_pixels") or MAX_PIXELS,
        }
        processed = AutoImageProcessor.from_pretrained(str(folder))(
            images=images, return_tensors="pt", size=size
        )
        out["pixel_values"] = processed["pixel_values"]
        out["image_grid_thw"] = grids = processed["image_grid_thw"]
        pieces = text.split("<|image_pad|>")
        text = pieces[0] + "".join(
            "<|image_pad|>" * (int(grid.prod()) // 4) + piece
            for grid, piece in zip(grids, pieces[1:], strict=True)
        )
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out["input_ids"] = ids
    out["attention_mask"] = torch.ones_like(ids)
    out["mm_token_type_ids"] = (ids == image_id).to(torch.int32)
    return out
