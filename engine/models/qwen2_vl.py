"""Qwen2-VL: a dynamic-resolution vision tower in front of a Qwen2 decoder with M-RoPE.

The decoder is :class:`~engine.models.llama.LlamaForCausalLM` (Qwen2 is a Llama with q/k/v
biases) with one change: multimodal rotary embedding. Each head's ``d / 2`` rotary frequencies
are cut into three sections (``mrope_section``, e.g. 16/24/24); a token rotates the first by
its temporal position, the second by its height position, the third by its width position.
Text tokens carry the same number in all three, so for them M-RoPE is plain RoPE; an image's
tokens carry (start, start + row, start + column) of their cell in the merged patch grid, and
the text after an image continues from the largest position the image used, plus one. The
request's three rows are computed once when it is created (engine/multimodal.py
``mrope_positions``); the runner slices them per step (chunked prefill, prefix-cache hits and
recompute after preemption read the same rows), and a decode step's position is its index
plus the request's ``mrope_delta``. :class:`MRotaryEmbedding` turns a step's ``[3, T]``
positions into one cos/sin row per token, so the attention kernels are unchanged.

The vision tower follows transformers' ``Qwen2VisionTransformerPretrainedModel``: patches of
``temporal_patch_size`` (2) frames x ``patch_size`` (14) squared pixels through a 3D
convolution, blocks of bidirectional attention with a 2D rotary embedding (half the rotary
frequencies for the row, half for the column), then the merger: a LayerNorm and a two-layer
MLP over each 2x2 block of neighbouring patches, one decoder row per block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llava import _activation
from engine.models.rotary import RopeAngles, RotaryEmbedding
from portico.contract import (
    QWEN2_VL_MAX_PIXELS,
    QWEN2_VL_MIN_PIXELS,
    pixel_options_error,
    qwen2_vl_image_grid,
)

# What a request's mm_processor_kwargs may set (vLLM's names for Qwen2-VL).
MM_PROCESSOR_KWARGS = ("min_pixels", "max_pixels")
# A vision block's attention spans: consecutive row counts, or None for all rows at once.
Windows = Sequence[int] | None


@dataclass(frozen=True)
class Qwen2VLVisionConfig:
    """The vision half of a Qwen2-VL config.json (transformers' names and defaults)."""

    depth: int
    embed_dim: int
    out_dim: int  # the decoder's hidden size (vision_config.hidden_size)
    num_heads: int
    mlp_ratio: float
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    hidden_act: str
    rope_theta: float
    image_token_id: int
    mrope_section: tuple[int, ...]

    @classmethod
    def from_multimodal(cls, raw: Mapping[str, Any]) -> Self:
        vision = dict(raw.get("vision_config") or {})
        rope = dict(vision.get("rope_parameters") or {})
        section = raw.get("mrope_section")
        if not isinstance(section, list) or len(section) != 3:
            raise ValueError("a Qwen2-VL config.json needs rope mrope_section (three numbers)")
        if raw.get("image_token_id") is None:
            raise ValueError("a Qwen2-VL config.json needs image_token_id")
        return cls(
            depth=int(vision.get("depth", 32)),
            embed_dim=int(vision.get("embed_dim", 1280)),
            out_dim=int(vision.get("hidden_size", 3584)),
            num_heads=int(vision.get("num_heads", 16)),
            mlp_ratio=float(vision.get("mlp_ratio", 4)),
            in_channels=int(vision.get("in_channels", 3)),
            patch_size=int(vision.get("patch_size", 14)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            hidden_act=str(vision.get("hidden_act", "quick_gelu")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            image_token_id=int(raw["image_token_id"]),
            mrope_section=tuple(int(x) for x in section),
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention over one image's patches, q and k rotated by their (row,
    column) in float32."""

    def __init__(self, cfg: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: Windows = None
    ) -> torch.Tensor:
        """``windows`` (consecutive row counts) cuts the rows into spans that attend only
        within themselves (Qwen2.5-VL's window attention); None: one span, every patch."""
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, -1).unbind(1)  # [rows, heads, d]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        spans = list(windows) if windows is not None else [rows]
        out = torch.cat(
            [
                nn.functional.scaled_dot_product_attention(*parts)
                for parts in zip(*(t.split(spans, dim=2) for t in (q, k, v)), strict=True)
            ],
            dim=2,
        )
        return self.proj(out[0].transpose(0, 1).reshape(rows, -1))


class VisionMlp(nn.Module):
    """fc2(act(fc1(x)))."""

    def __init__(self, cfg: Qwen2VLVisionConfig) -> None:
        super().__init__()
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, cfg.embed_dim)
        self.act = _activation(cfg.hidden_act, "vision hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x)). ``norm`` and ``mlp`` are
    Qwen2-VL's (LayerNorm, fc1/fc2) unless a subclass's tower passes its own."""

    def __init__(
        self, cfg: Qwen2VLVisionConfig, norm: type[nn.Module] = nn.LayerNorm,
        mlp: type[nn.Module] = VisionMlp,
    ) -> None:  # fmt: skip
        super().__init__()
        self.norm1 = norm(cfg.embed_dim, eps=1e-6)
        self.norm2 = norm(cfg.embed_dim, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = mlp(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: Windows = None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Each row of ``pixel_values`` (C x temporal x patch x patch values) to one patch row."""

    def __init__(self, cfg: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(
            cfg.in_channels, cfg.embed_dim, kernel_size=self.shape[1:], stride=self.shape[1:],
            bias=False,
        )  # fmt: skip

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class PatchMerger(nn.Module):
    """A norm (LayerNorm; RMSNorm in Qwen2.5-VL), then an MLP over each 2x2 block of patches
    (their rows side by side)."""

    def __init__(self, cfg: Qwen2VLVisionConfig, norm: type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size**2
        self.ln_q = norm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTower(nn.Module):
    """transformers' ``Qwen2VisionTransformerPretrainedModel`` for one image at a time."""

    def __init__(
        self, cfg: Qwen2VLVisionConfig, norm: type[nn.Module] = nn.LayerNorm,
        mlp: type[nn.Module] = VisionMlp,
    ) -> None:  # fmt: skip
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg, norm, mlp) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, norm)

    def rotary(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, ...]:
        """Cos and sin ``[patches, 1, head_dim]`` of each patch's (row, column), the patches
        in the processor's order: 2x2 merge blocks row-major, each block's patches row-major."""
        t, h, w = grid
        m = self.cfg.spatial_merge_size
        rows = torch.arange(h, device=device).view(-1, 1).expand(h, w)
        cols = torch.arange(w, device=device).view(1, -1).expand(h, w)
        rows, cols = (
            x.reshape(h // m, m, w // m, m).transpose(1, 2).flatten() for x in (rows, cols)
        )
        half = self.cfg.embed_dim // self.cfg.num_heads // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float32, device=device) / half
        inv_freq = 1.0 / (self.cfg.rope_theta**exponents)
        freqs = torch.cat(
            [torch.outer(rows.float(), inv_freq), torch.outer(cols.float(), inv_freq)], -1
        )
        freqs = torch.cat([freqs, freqs], dim=-1).repeat(t, 1).unsqueeze(1)
        return freqs.cos(), freqs.sin()

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """``[t * h * w, C * 2 * 14 * 14]`` patches of one image (patch grid ``grid``) to
        ``[t * h * w / 4, out_dim]`` decoder rows. A still image has t = 1: one frame, one
        attention span."""
        if grid[0] != 1:
            raise ValueError("only still images (one temporal patch) are served")
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grid, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.merger(x)


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose step positions may be ``[3, T]`` (temporal, height, width): frequency ``j``
    of a token takes the cos/sin of the row that ``mrope_section`` assigns it. A ``[T]`` step
    (text and decodes: all three equal) is plain RoPE."""

    def __init__(
        self, cfg: ModelConfig, section: Sequence[int], device: torch.device | str | None = None
    ) -> None:
        super().__init__(cfg, device)
        if sum(section) != cfg.head_dim // 2:
            raise ValueError(
                f"mrope_section {list(section)} must add up to head_dim / 2 = {cfg.head_dim // 2}"
            )
        self.section = tuple(section)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        tokens = positions.shape[1]
        which = torch.repeat_interleave(
            torch.arange(3, device=positions.device),
            torch.tensor(self.section, device=positions.device),
        ).expand(1, tokens, -1)
        cos = self.cos[positions].gather(0, which)[0]  # [T, d / 2] float32, one row a token
        sin = self.sin[positions].gather(0, which)[0]
        # The rows are their own tables (row t at position t): the in-place kernels read
        # table[positions[t]] and rotate by exactly these angles.
        rows = torch.arange(tokens, device=positions.device)
        return RopeAngles(cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype), rows, cos, sin)


@dataclass(frozen=True)
class PreparedImage:
    """One picture as the engine takes it: patches, the decoder positions it fills, and its
    merged grid ``(t, h, w)`` (one token per cell) for M-RoPE."""

    pixel_values: torch.Tensor  # [t * h * w * 4, C * 2 * 14 * 14] float32
    num_tokens: int
    grid: tuple[int, int, int]


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """A Qwen2 decoder with M-RoPE that also turns images into rows of its input."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if cfg.multimodal is None:
            raise ValueError(f"{cfg.architecture} needs its vision config")
        self.vision, self.visual = self.vision_tower(cfg.multimodal)
        self.rotary_emb = MRotaryEmbedding(cfg, self.vision.mrope_section)
        self.image_processor: Any = None  # the folder's transformers image processor (loader)

    def vision_tower(self, raw: Mapping[str, Any]) -> tuple[Qwen2VLVisionConfig, Qwen2VisionTower]:
        """The vision config read from config.json, and the tower it builds."""
        vision = Qwen2VLVisionConfig.from_multimodal(raw)
        return vision, Qwen2VisionTower(vision)

    def pixel_bounds(self, options: Mapping[str, Any] | None) -> tuple[int, int]:
        """``(min_pixels, max_pixels)``: the folder's, with a request's mm_processor_kwargs
        over them (checked: whole numbers, min <= max <= QWEN2_VL_MAX_PIXELS_LIMIT)."""
        from engine.multimodal import ImageError

        size = dict(getattr(self.image_processor, "size", None) or {})
        bounds = {
            "min_pixels": int(size.get("shortest_edge") or QWEN2_VL_MIN_PIXELS),
            "max_pixels": int(size.get("longest_edge") or QWEN2_VL_MAX_PIXELS),
        }
        for key in options or {}:
            if key not in MM_PROCESSOR_KWARGS:
                known = ", ".join(MM_PROCESSOR_KWARGS)
                raise ImageError(
                    f"mm_processor_kwargs.{key}", f"not a setting of this model ({known})"
                )
        problem = pixel_options_error(options or {})
        if problem is not None:
            raise ImageError(*problem)
        bounds.update({k: int(v) for k, v in (options or {}).items() if v is not None})
        if bounds["min_pixels"] > bounds["max_pixels"]:
            raise ImageError("mm_processor_kwargs", "min_pixels must not exceed max_pixels")
        return bounds["min_pixels"], bounds["max_pixels"]

    def prepare_images(
        self, images: Sequence[Any], options: Mapping[str, Any] | None = None
    ) -> list[PreparedImage]:
        """Pillow images resized, normalised and cut into patches by the folder's image
        processor, each with its size-dependent token count (portico.contract's rule, which
        the gateway counts by: the two must agree)."""
        from engine.multimodal import ImageError

        low, high = self.pixel_bounds(options)
        merge = self.vision.spatial_merge_size
        out: list[PreparedImage] = []
        for image in images:
            try:
                grid = qwen2_vl_image_grid(
                    self.config.multimodal or {}, image.height, image.width, low, high
                )
            except ValueError as exc:  # an aspect ratio past 200:1
                raise ImageError("messages", str(exc)) from None
            made = self.image_processor(
                images=[image], return_tensors="pt",
                size={"shortest_edge": low, "longest_edge": high},
            )  # fmt: skip
            if tuple(int(x) for x in made["image_grid_thw"][0]) != grid:
                raise RuntimeError(
                    f"the image processor made grid {made['image_grid_thw'][0].tolist()}, the "
                    f"contract's rule {list(grid)}: the folder's preprocessing is not Qwen2-VL's"
                )
            t, h, w = grid
            merged = (t, h // merge, w // merge)
            pixels = made["pixel_values"].to(torch.float32)
            out.append(PreparedImage(pixels, merged[0] * merged[1] * merged[2], merged))
        return out

    def encode_image(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches to ``[tokens, hidden]`` rows in the decoder's dtype; ``grid``
        is the merged grid the image's tokens fill."""
        m = self.vision.spatial_merge_size
        patches = (grid[0], grid[1] * m, grid[2] * m)
        weight = self.visual.patch_embed.proj.weight
        rows = self.visual(pixel_values.to(weight.device, weight.dtype), patches)
        return rows.to(self.model.embed_tokens.weight.dtype)


def rename_qwen2_vl_weights(name: str) -> str | None:
    """A transformers Qwen2-VL checkpoint's tensor name as ours: the original layout
    (``model.layers.*``, ``visual.*``, ``lm_head.*``) as is, and transformers 5's
    (``model.language_model.*``, ``model.visual.*``)."""
    for theirs, ours in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name
