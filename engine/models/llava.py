"""LLaVA: a CLIP or SigLIP vision tower and a two-layer projector in front of a Llama decoder.

The decoder is :class:`~engine.models.llama.LlamaForCausalLM` unchanged (paged KV cache, the
kernel front door); this module adds what turns an image into rows of the decoder's input:
``encode_images(pixel_values)`` returns ``[num_images, image_tokens, hidden]``, which the
model runner writes over the embeddings of the prompt's image placeholder tokens in the step
that prefills them. The numbers follow transformers' ``LlavaForConditionalGeneration`` and
``CLIPVisionModel`` / ``SiglipVisionModel`` (hidden states of ``vision_feature_layer``, the
first row dropped under the ``default`` strategy, as transformers does for either tower,
``linear_2(act(linear_1(x)))``), so a folder saved by transformers loads and answers as it does
there. SigLIP differs from CLIP in its embeddings only (a patch convolution with a bias, one
learned position per patch, no CLS row, no layer norm before the encoder); its encoder layers
are CLIP's, and its pooling head, which LLaVA never reads, is not loaded. The vision tower
runs on plain torch ops: it is a few small matmuls per image, once per image, beside a
prompt's worth of decoder work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from portico.contract import VISION_ARCHITECTURES, tokens_per_image

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": nn.functional.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "silu": nn.functional.silu,
}


def _activation(name: str, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"{what} '{name}' is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


# transformers' defaults where the two towers' configs differ (CLIPVisionConfig,
# SiglipVisionConfig): a config.json leaves out what equals its class's default.
_TOWER_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": {"num_hidden_layers": 24, "patch_size": 32, "layer_norm_eps": 1e-5,
                          "hidden_act": "quick_gelu"},
    "siglip_vision_model": {"num_hidden_layers": 12, "patch_size": 16, "layer_norm_eps": 1e-6,
                            "hidden_act": "gelu_pytorch_tanh"},
}  # fmt: skip


@dataclass(frozen=True)
class VisionConfig:
    """The vision half of a LLaVA config.json (transformers' names and defaults)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    image_token_id: int
    feature_layer: int  # index into the tower's hidden states (0: the embeddings)
    keep_cls: bool  # vision_feature_select_strategy "full"
    projector_act: str
    projector_bias: bool
    # Decoder positions one image fills (portico.contract.tokens_per_image)
    num_image_tokens: int

    tower: str  # "clip_vision_model" or "siglip_vision_model"

    @classmethod
    def from_multimodal(cls, raw: Mapping[str, Any]) -> VisionConfig:
        vision = dict(raw.get("vision_config") or {})
        tower = vision.get("model_type", "clip_vision_model")
        if tower not in _TOWER_DEFAULTS:
            raise ValueError(
                f"vision tower '{tower}' is not supported ({', '.join(_TOWER_DEFAULTS)})"
            )
        default = _TOWER_DEFAULTS[tower]
        layers = int(vision.get("num_hidden_layers", default["num_hidden_layers"]))
        feature_layer = raw.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int) or not -layers - 1 <= feature_layer <= layers:
            raise ValueError(
                f"vision_feature_layer {feature_layer!r} is not supported (one layer index)"
            )
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy '{strategy}' is not supported")
        image_token = raw.get("image_token_index", raw.get("image_token_id"))
        if image_token is None:
            raise ValueError("a LLaVA config.json needs image_token_index")
        return cls(
            hidden_size=int(vision.get("hidden_size", 768)),
            intermediate_size=int(vision.get("intermediate_size", 3072)),
            num_hidden_layers=layers,
            num_attention_heads=int(vision.get("num_attention_heads", 12)),
            image_size=int(vision.get("image_size", 224)),
            patch_size=int(vision.get("patch_size", default["patch_size"])),
            num_channels=int(vision.get("num_channels", 3)),
            layer_norm_eps=float(vision.get("layer_norm_eps", default["layer_norm_eps"])),
            hidden_act=str(vision.get("hidden_act", default["hidden_act"])),
            image_token_id=int(image_token),
            feature_layer=feature_layer % (layers + 1),
            keep_cls=strategy == "full",
            projector_act=str(raw.get("projector_hidden_act", "gelu")),
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
            num_image_tokens=tokens_per_image({**raw, "architectures": VISION_ARCHITECTURES}) or 0,
            tower=tower,
        )


class CLIPEmbeddings(nn.Module):
    """Patches (a strided convolution) after a learned CLS row, plus learned positions."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        size = cfg.hidden_size
        self.class_embedding = nn.Parameter(torch.zeros(size))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, size, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2 + 1, size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [N, patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over one image's rows."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.q_proj = nn.Linear(size, size)
        self.k_proj = nn.Linear(size, size)
        self.v_proj = nn.Linear(size, size)
        self.out_proj = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, rows, size = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, rows, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, rows, size))


class CLIPMLP(nn.Module):
    """fc2(act(fc1(x)))."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _activation(cfg.hidden_act, "vision hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoder(nn.Module):
    """The stack of encoder layers (its own module: checkpoints name it ``encoder``)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class CLIPEncoderLayer(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + fc2(act(fc1(ln2(x))))."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        size = cfg.hidden_size
        self.layer_norm1 = nn.LayerNorm(size, eps=cfg.layer_norm_eps)
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionTower(nn.Module):
    """transformers' ``CLIPVisionModel`` up to the hidden states LLaVA reads.

    Layers past ``feature_layer`` (and ``post_layernorm``) are loaded, so a checkpoint's
    weights match, but never run: LLaVA does not read them.
    """

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.feature_layer = cfg.feature_layer
        self.embeddings = CLIPEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = CLIPEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, 1 + patches, hidden]`` after ``feature_layer`` layers."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers[: self.feature_layer]:
            x = layer(x)
        return x


class SiglipEmbeddings(nn.Module):
    """Patches (a strided convolution with a bias) plus one learned position per patch."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        size = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, size, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2, size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """transformers' ``SiglipVisionModel`` up to the hidden states LLaVA reads (as
    :class:`CLIPVisionTower`: later layers and ``post_layernorm`` loaded, never run)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.feature_layer = cfg.feature_layer
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = CLIPEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, patches, hidden]`` after ``feature_layer`` layers."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers[: self.feature_layer]:
            x = layer(x)
        return x


class LlavaProjector(nn.Module):
    """Vision hidden size to the decoder's: ``linear_2(act(linear_1(x)))``."""

    def __init__(self, cfg: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cfg.hidden_size, text_hidden, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=cfg.projector_bias)
        self.act = _activation(cfg.projector_act, "projector_hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """A Llama-family decoder that also turns images into rows of its input.

    Everything the runner, the loader and the CUDA graphs call on a text model works the same
    (it *is* one); :meth:`encode_images` and ``forward(..., inputs_embeds=...)`` are the image
    path. ``vision`` says how many placeholder tokens an image fills and which id they carry.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if cfg.multimodal is None:
            raise ValueError(f"{cfg.architecture} needs its vision config")
        self.vision = VisionConfig.from_multimodal(cfg.multimodal)
        siglip = self.vision.tower == "siglip_vision_model"
        self.vision_tower: nn.Module = (SiglipVisionTower if siglip else CLIPVisionTower)(
            self.vision
        )
        self.multi_modal_projector = LlavaProjector(self.vision, cfg.hidden_size)
        # transformers' image processor of the folder (set by the loader): what a picture
        # becomes before encode_images.
        self.image_processor: Any = None

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` preprocessed images to ``[N, num_image_tokens, hidden]`` rows in
        the decoder's dtype."""
        hidden = self.vision_tower(pixel_values)
        if not self.vision.keep_cls:  # "default": the first row goes, whichever the tower
            hidden = hidden[:, 1:]
        return self.multi_modal_projector(hidden).to(self.model.embed_tokens.weight.dtype)


def rename_llava_weights(name: str) -> str | None:
    """A transformers LLaVA checkpoint's tensor name as ours (both the layout transformers 4
    saved, ``language_model.model.*``, and the newer ``model.language_model.*``); None for a
    tensor we do not keep."""
    if name.startswith("model.") and not name.startswith("model.language_model."):
        name = name[len("model.") :]  # model.vision_tower.*, model.multi_modal_projector.*
    for theirs, ours in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.vision_model.", "vision_tower."),
    ):
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    if name.startswith("vision_tower.") and name.endswith("position_ids"):
        return None
    if name.startswith(("vision_tower.head.", "vision_tower.vision_model.head.")):
        return None  # SigLIP's pooling head: LLaVA reads the hidden states, never the head
    return name
