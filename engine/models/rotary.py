"""Rotary position embedding (RoPE) and its scaling variants: default, linear, llama3, yarn.

The inverse frequencies follow Hugging Face's definitions so our logits match transformers'.
Cos/sin tables are precomputed in float32 for every position the model accepts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from engine.model_config import ModelConfig


def _linear_ramp(low: float, high: float, dim: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # avoid a division by zero, as the YaRN reference does
    return torch.clamp((torch.arange(dim, dtype=torch.float32) - low) / (high - low), 0, 1)


def _yarn(inv_freq: torch.Tensor, cfg: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    params = cfg.rope_scaling or {}
    factor = float(params["factor"])
    original = int(params["original_max_position_embeddings"])
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    base = cfg.rope_theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    extrapolation = 1 - _linear_ramp(low, high, dim // 2)
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    params = cfg.rope_scaling or {}
    factor = float(params["factor"])
    low_ff = float(params["low_freq_factor"])
    high_ff = float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low_ff, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high_ff) & (wavelen <= old_len / low_ff)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float32) and the factor applied to cos/sin."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    kind = cfg.rope_type
    if kind == "linear":
        return inv_freq / float((cfg.rope_scaling or {})["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, cfg), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, cfg, dim)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Applies RoPE (Hugging Face's rotate-half layout) to query and key heads in one call."""

    cos: torch.Tensor  # [max_positions, d / 2] float32 buffers
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(0, device=device), persistent=False)
        self.register_buffer("sin", torch.empty(0, device=device), persistent=False)
        if torch.empty(0, device=device).device.type != "meta":
            self.build_tables()

    def build_tables(self) -> None:
        """(Re)compute the cos/sin tables on the module's device, for every allowed position."""
        device = self.cos.device
        inv_freq, attention_factor = rope_inv_freq(self.cfg)
        positions = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, d / 2]
        self.cos = (freqs.cos() * attention_factor).to(device)
        self.sin = (freqs.sin() * attention_factor).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        """Cos/sin rows for ``positions`` ([T]), once per step, shared by every layer."""
        return RopeAngles(
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
            positions,
            self.cos,
            self.sin,
        )


class RopeAngles(NamedTuple):
    """Cos and sin ([T, 1, d / 2]) of one step's positions, in the model's dtype; and the
    positions with the whole float32 tables, for kernels that rotate in place."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
