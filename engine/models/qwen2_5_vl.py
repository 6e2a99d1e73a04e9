"""Qwen2.5-VL: Qwen2-VL's decoder and M-RoPE, with a windowed vision tower.

Everything outside the vision tower is Qwen2-VL's (engine/models/qwen2_vl.py): the Qwen2
decoder with M-RoPE and its ``mrope_section``, the image processor, the size-dependent token
count, placement and the per-request positions. A still image's M-RoPE positions are the same
as in Qwen2-VL (``second_per_grid_ts`` only spaces video frames, which are not served).

The tower follows transformers' ``Qwen2_5_VisionTransformerPretrainedModel``; against
Qwen2-VL's it has RMSNorm for LayerNorm (in the blocks and the merger), a SwiGLU MLP
(``gate_proj``, ``up_proj``, ``down_proj``, with biases), and window attention: the merged
grid is cut into squares of ``window_size / patch_size / spatial_merge_size`` cells (the last
row and column of squares may be smaller), the patches are reordered window by window (each
2x2 merge block kept together), the blocks named in ``fullatt_block_indexes`` attend over the
whole image and the others only within their window, and the merger's rows are put back in
the grid's order at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from engine.models.llama import RMSNorm
from engine.models.llava import _activation
from engine.models.qwen2_vl import (
    Qwen2VisionTower,
    Qwen2VLForConditionalGeneration,
    Qwen2VLVisionConfig,
)


@dataclass(frozen=True)
class Qwen25VLVisionConfig(Qwen2VLVisionConfig):
    """The vision half of a Qwen2.5-VL config.json: Qwen2-VL's fields (``hidden_size`` is the
    tower's width here, ``out_hidden_size`` the decoder's) and the window attention's."""

    intermediate_size: int = 3420
    window_size: int = 112  # pixels of a window's side
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)

    @classmethod
    def from_multimodal(cls, raw: Mapping[str, Any]) -> Self:
        vision = dict(raw.get("vision_config") or {})
        # Qwen2-VL's names for the same numbers: the tower's width, the decoder's width
        # (transformers' defaults when absent).
        renamed = {
            **vision,
            "embed_dim": vision.get("hidden_size", 3584),
            "hidden_size": vision.get("out_hidden_size", 3584),
            "hidden_act": vision.get("hidden_act", "silu"),
        }
        base = super().from_multimodal({**raw, "vision_config": renamed})
        return dataclasses.replace(
            base,
            intermediate_size=int(vision.get("intermediate_size", 3420)),
            window_size=int(vision.get("window_size", 112)),
            fullatt_block_indexes=tuple(
                int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31))
            ),
        )


class VisionSwiGlu(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), every linear with a bias."""

    def __init__(self, cfg: Qwen25VLVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.embed_dim, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.embed_dim, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.embed_dim)
        self.act = _activation(cfg.hidden_act, "vision hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def window_order(
    grid: tuple[int, int, int], merge: int, cells: int
) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks of a patch grid ``(t, h, w)`` in window order (transformers'
    ``get_vision_window_index``): squares of ``cells`` x ``cells`` merge blocks, row by row,
    each square's blocks row-major; and each window's patch count (``merge ** 2`` a block)."""
    t, h, w = grid
    rows, cols = h // merge, w // merge
    index = torch.arange(t * rows * cols).view(t, rows, cols)
    order: list[torch.Tensor] = []
    sizes: list[int] = []
    for frame in index:
        for top in range(0, rows, cells):
            for left in range(0, cols, cells):
                square = frame[top : top + cells, left : left + cells].flatten()
                order.append(square)
                sizes.append(square.numel() * merge * merge)
    return torch.cat(order), sizes


class Qwen25VisionTower(Qwen2VisionTower):
    """transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` for one image at a time."""

    def __init__(self, cfg: Qwen25VLVisionConfig) -> None:
        super().__init__(cfg, RMSNorm, VisionSwiGlu)
        self.windowed = cfg

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """``[t * h * w, C * 2 * 14 * 14]`` patches of one image (patch grid ``grid``) to
        ``[t * h * w / 4, out_dim]`` decoder rows, in the grid's order."""
        if grid[0] != 1:
            raise ValueError("only still images (one temporal patch) are served")
        cfg = self.windowed
        unit = cfg.spatial_merge_size**2
        cells = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        order, windows = window_order(grid, cfg.spatial_merge_size, cells)
        order = order.to(pixel_values.device)

        def by_window(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, unit, *t.shape[1:])[order].flatten(0, 1)

        x = by_window(self.patch_embed(pixel_values))
        cos, sin = (by_window(t) for t in self.rotary(grid, x.device))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if i in cfg.fullatt_block_indexes else windows)
        return self.merger(x)[torch.argsort(order)]


class Qwen25VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's model (decoder, M-RoPE, images) with Qwen2.5-VL's vision tower."""

    def vision_tower(self, raw: Mapping[str, Any]) -> tuple[Qwen2VLVisionConfig, Qwen2VisionTower]:
        vision = Qwen25VLVisionConfig.from_multimodal(raw)
        return vision, Qwen25VisionTower(vision)
