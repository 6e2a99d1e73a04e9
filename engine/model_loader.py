"""Load a Llama-family model from a Hugging Face folder or a GGUF file.

``load_model(source, dtype, device)`` returns a :class:`LoadedModel`: our
:class:`~engine.models.llama.LlamaForCausalLM` with merged q/k/v and gate/up weights, its
:class:`~engine.model_config.ModelConfig`, and the tokenizer (``AutoTokenizer``; for GGUF the
tokenizer stored in the file). GGUF tensors are dequantized at load (``gguf.quants``) and the
row permutation that llama.cpp's converter applies to Llama q/k weights is undone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.registry import ModelNotFound, ModelSource


@dataclass
class LoadedModel:
    """A model ready to run: weights on their device, its architecture, its tokenizer."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    name: str = ""

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype


def choose_device(spec: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU; otherwise the named device."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{spec}' was asked for but CUDA is not available")
    return device


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def choose_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, float32 on CPU; otherwise the named dtype."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got '{spec}'")
    return _DTYPES[spec]


# --------------------------------------------------------------------------- Hugging Face


def _hf_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"Model folder '{folder}' has no .safetensors weights.")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _merge_hf(cfg: ModelConfig, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Rename HF tensors to ours, stacking q/k/v into qkv_proj and gate/up into gate_up_proj."""
    raw: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        raw[name] = tensor
    state: dict[str, Any] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            parts = [raw.pop(f"{p}self_attn.{n}_proj.{suffix}") for n in ("q", "k", "v")]
            state[f"{p}self_attn.qkv_proj.{suffix}"] = torch.cat(parts, dim=0)
        for suffix in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            parts = [raw.pop(f"{p}mlp.{n}_proj.{suffix}") for n in ("gate", "up")]
            state[f"{p}mlp.gate_up_proj.{suffix}"] = torch.cat(parts, dim=0)
    state.update(raw)
    return state


def _load_hf(folder: Path) -> tuple[ModelConfig, dict[str, Any], PreTrainedTokenizerBase]:
    raw_config = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw_config)
    state = _merge_hf(cfg, _hf_tensors(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return cfg, state, tokenizer


# --------------------------------------------------------------------------- GGUF


def _gguf_metadata(reader: Any) -> dict[str, Any]:
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges")
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def _unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> Hugging Face's rotate-half order)."""
    rows, cols = weight.shape[0], weight.shape[1:]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *cols)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _load_gguf(path: Path) -> tuple[ModelConfig, dict[str, Any], PreTrainedTokenizerBase]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        array = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not array.flags.writeable:  # F32 tensors come back as views of the mapped file
            array = array.copy()
        tensors[t.name] = torch.from_numpy(array)
    meta = _gguf_metadata(reader)
    tied = "output.weight" not in tensors
    cfg = ModelConfig.from_gguf_metadata(
        meta, vocab_size=tensors["token_embd.weight"].shape[0], tied=tied
    )
    permuted = cfg.architecture == "LlamaForCausalLM"
    state: dict[str, Any] = {
        "model.embed_tokens.weight": tensors.pop("token_embd.weight"),
        "model.norm.weight": tensors.pop("output_norm.weight"),
    }
    if not tied:
        state["lm_head.weight"] = tensors.pop("output.weight")
    for i in range(cfg.num_hidden_layers):
        blk, p = f"blk.{i}.", f"model.layers.{i}."
        q, k = tensors.pop(f"{blk}attn_q.weight"), tensors.pop(f"{blk}attn_k.weight")
        if permuted:
            q = _unpermute_qk(q, cfg.num_attention_heads)
            k = _unpermute_qk(k, cfg.num_key_value_heads)
        v = tensors.pop(f"{blk}attn_v.weight")
        state[f"{p}self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        if cfg.qkv_bias:
            biases = [tensors.pop(f"{blk}attn_{n}.bias") for n in ("q", "k", "v")]
            state[f"{p}self_attn.qkv_proj.bias"] = torch.cat(biases)
        gate, up = tensors.pop(f"{blk}ffn_gate.weight"), tensors.pop(f"{blk}ffn_up.weight")
        state[f"{p}mlp.gate_up_proj.weight"] = torch.cat([gate, up])
        for ours_suffix, theirs in ((v, k) for k, v in _GGUF_NAMES.items()):
            state[p + ours_suffix] = tensors.pop(blk + theirs)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return cfg, state, tokenizer


# --------------------------------------------------------------------------- entry point


def load_model(
    source: ModelSource, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LoadedModel:
    """Load ``source`` (``format`` "hf" or "gguf") as ``dtype`` weights on ``device``.

    Raises :class:`~engine.registry.ModelNotFound` (a ``ValueError``) naming the model when its
    files are missing, and ``ValueError`` for an unsupported architecture.
    """
    path = Path(source.path)
    if source.format == "gguf":
        if not path.is_file():
            raise ModelNotFound(f"Model '{source.name}': GGUF file '{path}' does not exist.")
        cfg, state, tokenizer = _load_gguf(path)
    elif source.format == "hf":
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"Model '{source.name}': '{path}' has no config.json.")
        cfg, state, tokenizer = _load_hf(path)
    else:
        raise ValueError(f"Model '{source.name}': unknown format '{source.format}' (hf, gguf)")
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = {name: tensor.to(dtype) for name, tensor in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"Model '{source.name}': weights do not match the {cfg.architecture} layout "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    model.rotary_emb.cos = torch.empty(0)  # the tables were skipped on the meta device
    model.rotary_emb.build_tables()
    model.to(device)
    model.eval()
    return LoadedModel(model=model, config=cfg, tokenizer=tokenizer, name=source.name)
