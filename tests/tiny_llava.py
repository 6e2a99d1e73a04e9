"""A tiny random LLaVA for tests, as a real Hugging Face folder.

A 2-layer CLIP vision tower, the two-linear projector and a tiny Llama, saved with
transformers' ``save_pretrained`` together with a processor (a CLIP image processor and
SmolLM2's tokenizer with an added ``<image>`` token and a LLaVA-1.5 style chat template).
Importable by any test (``from tiny_llava import build_tiny_llava``).
"""

from __future__ import annotations

from pathlib import Path

from tiny_llama import TINY_LLAMA_CONFIG, _load_real_tokenizer

from load.vision_bench import CHAT_TEMPLATE  # LLaVA-1.5's, images before the text of a turn

IMAGE_SIZE = 32
PATCH_SIZE = 8  # (32 / 8)^2 = 16 patches: 16 image tokens per image (the CLS row dropped)


def build_tiny_llava(
    folder: Path, seed: int = 0, tower: str = "clip", strategy: str | None = None
) -> Path:
    """Write a random LLaVA (config, safetensors, processor files) to ``folder``: a CLIP tower
    (``tower="clip"``, the "default" strategy: 16 tokens a picture) or a SigLIP one
    (``"siglip"``, with its pooling head, "full" unless ``strategy`` says: 16 tokens, 15 under
    "default")."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    tokenizer = _load_real_tokenizer()
    tokenizer = tokenizer.__class__.from_pretrained(str(_tokenizer_copy(tokenizer, folder)))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **dict(TINY_LLAMA_CONFIG, tie_word_embeddings=False),
    )
    shape = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE,
    }  # fmt: skip
    if tower == "siglip":
        vision = SiglipVisionConfig(**shape)
        strategy = strategy or "full"
        images = SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        extra_rows = 0  # no CLS row
    else:
        vision = CLIPVisionConfig(**shape, projection_dim=32)
        strategy = strategy or "default"
        crop = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size=crop)
        extra_rows = 1
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        projector_hidden_act="gelu", vision_feature_layer=-2,
        vision_feature_select_strategy=strategy, image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed_tokens" in name else 0.08)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    processor = LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy=strategy, chat_template=CHAT_TEMPLATE,
        num_additional_image_tokens=extra_rows,
    )  # fmt: skip
    processor.save_pretrained(folder)
    return folder


def _tokenizer_copy(tokenizer, folder: Path) -> Path:  # type: ignore[no-untyped-def]
    """SmolLM2's tokenizer saved into ``folder`` (a fresh copy each build gets the new token)."""
    target = folder / "_tokenizer_src"
    tokenizer.save_pretrained(str(target))
    return target
