"""One LoRA adapter in PEFT's format, read and laid out for the model's fused projections.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``) and ``adapter_model.safetensors`` with ``...layers.{i}.{self_attn|mlp}.
{name}.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``. Our model fuses q/k/v
into ``qkv_proj`` and gate/up into ``gate_up_proj``, so each fused module gets one A of
``num_parts * max_rank`` rows (part ``i`` owns rows ``[i * max_rank, i * max_rank + r)``) and
one B whose output rows of part ``i`` read only part ``i``'s columns: block-diagonal, exactly
the sum of the separate projections' deltas. The scaling (``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA) is folded into B once, at load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model_config import ModelConfig

# Hugging Face projection name -> (our fused module, part index within it).
PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# Fused module -> how many projections share it.
NUM_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
_KEY_RE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served here; the message says why (a 400 at runtime load)."""


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: its served ``name``, a ``lora_int_id`` unique to this
    registration (part of the prefix-cache hash, so a re-registered name never reuses the old
    adapter's KV), and the folder its weights are read from (again, after an LRU eviction)."""

    name: str
    lora_int_id: int
    path: str
    base_model_name: str | None = None


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Each fused module's input width and the output widths of its parts."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {
        "qkv_proj": (cfg.hidden_size, [q, kv, kv]),
        "o_proj": (q, [cfg.hidden_size]),
        "gate_up_proj": (cfg.hidden_size, [inter, inter]),
        "down_proj": (inter, [cfg.hidden_size]),
    }


@dataclass
class LoRAWeights:
    """An adapter's fused A ``[layers][module] -> [parts * max_rank, in]`` and scaled B
    ``[out, parts * max_rank]`` tensors (float32, on the CPU), ready to copy into a slot."""

    request: LoRARequest
    rank: int
    a: list[dict[str, torch.Tensor]]
    b: list[dict[str, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        tensors = [t for layer in (*self.a, *self.b) for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def read_config(path: Path) -> dict[str, object]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"no adapter_config.json in '{path}' (expected a PEFT adapter folder)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"cannot read '{config_file}': {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"'{config_file}' is not a JSON object")
    return config


def _check_config(config: dict[str, object], max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling, or LoRAError for what we do not serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"peft_type {config.get('peft_type')!r} is not LoRA")
    for unsupported in ("use_dora", "fan_in_fan_out"):
        if config.get(unsupported):
            raise LoRAError(f"adapters with {unsupported}=true are not supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"modules_to_save {config['modules_to_save']} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"bias={config['bias']!r} is not supported (only 'none')")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAError("rank_pattern and alpha_pattern are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"adapter rank r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"adapter rank {rank} exceeds --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)  # type: ignore[call-overload]
    # A string is PEFT's regex form (checked against the tensors instead); a list names modules.
    for name in [] if isinstance(targets, str) else names:
        if not isinstance(name, str) or name.split(".")[-1] not in PROJECTIONS:
            raise LoRAError(
                f"target module '{name}' does not exist in this model; LoRA applies to "
                f"{', '.join(PROJECTIONS)}"
            )
    return rank, float(scale)


def load_adapter(
    request: LoRARequest, cfg: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAWeights:
    """Read ``request.path`` and lay it out for ``cfg``; LoRAError says what is wrong."""
    path = Path(request.path)
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter path '{request.path}' is not a folder")
    rank, scale = _check_config(read_config(path), max_rank)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRAError(f"no adapter_model.safetensors in '{path}'")
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # safetensors raises its own error types
        raise LoRAError(f"cannot read '{weights_file}': {exc}") from None
    shapes = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY_RE.search(key)
        if match is None:
            raise LoRAError(f"adapter tensor '{key}' targets a module this model does not have")
        layer, proj, which = int(match.group(1)), match.group(2), match.group(3)
        if proj not in PROJECTIONS or layer >= cfg.num_hidden_layers:
            raise LoRAError(f"adapter tensor '{key}' targets a module this model does not have")
        pairs.setdefault((layer, proj), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"'{weights_file}' holds no LoRA weights")
    a = [dict[str, torch.Tensor]() for _ in range(cfg.num_hidden_layers)]
    b = [dict[str, torch.Tensor]() for _ in range(cfg.num_hidden_layers)]
    for (layer, proj), pair in sorted(pairs.items()):
        module, part = PROJECTIONS[proj]
        in_features, outs = shapes[module]
        lora_a, lora_b = pair.get("A"), pair.get("B")
        if lora_a is None or lora_b is None:
            raise LoRAError(f"layer {layer} {proj} has lora_A or lora_B but not both")
        r = lora_a.shape[0]
        if r > max_rank:
            raise LoRAError(f"layer {layer} {proj} has rank {r} > --max-lora-rank {max_rank}")
        if tuple(lora_a.shape) != (r, in_features) or tuple(lora_b.shape) != (outs[part], r):
            raise LoRAError(
                f"layer {layer} {proj}: lora_A {tuple(lora_a.shape)} / lora_B "
                f"{tuple(lora_b.shape)} do not fit the model ({outs[part]} x {in_features})"
            )
        parts = NUM_PARTS[module]
        if module not in a[layer]:
            a[layer][module] = torch.zeros(parts * max_rank, in_features, dtype=dtype)
            b[layer][module] = torch.zeros(sum(outs), parts * max_rank, dtype=dtype)
        col = part * max_rank
        row = sum(outs[:part])
        a[layer][module][col : col + r] = lora_a.to(dtype)
        b[layer][module][row : row + outs[part], col : col + r] = (lora_b.float() * scale).to(dtype)
    return LoRAWeights(request, rank, a, b)
