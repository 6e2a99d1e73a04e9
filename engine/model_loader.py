"""Load a Llama-family model from a Hugging Face folder or a GGUF file.

``load_model(source, dtype, device)`` returns a :class:`LoadedModel`: our
:class:`~engine.models.llama.LlamaForCausalLM` with merged q/k/v and gate/up weights, its
:class:`~engine.model_config.ModelConfig`, and the tokenizer (``AutoTokenizer``; for GGUF the
tokenizer stored in the file). GGUF tensors are dequantized at load (:mod:`engine.gguf_file`,
``gguf.quants``) and the row permutation that llama.cpp's converter applies to Llama q/k
weights is undone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine import kernels
from engine.config import GGUF_ACTIVATIONS, LOAD_FORMATS, QUANTIZATIONS
from engine.gguf_file import GGUFFile
from engine.kernels.huge_pages import gather_on_huge_pages
from engine.model_config import ModelConfig
from engine.models.block_linear import BlockLinear, GGUFBlocks
from engine.models.fp8_linear import fp8_unsupported_reason, quantize_projections
from engine.models.fused_step import MAX_ROWS, FusedDecodeStep
from engine.models.llama import LlamaForCausalLM
from engine.models.llava import LlavaForConditionalGeneration, rename_llava_weights
from engine.models.panel_step import FusedPanelStep, use_native_norms
from engine.models.qwen2_5_vl import Qwen25VLForConditionalGeneration
from engine.models.qwen2_vl import Qwen2VLForConditionalGeneration, rename_qwen2_vl_weights
from engine.numerics import NumericsPath
from portico.contract import QWEN_VL_ARCHITECTURES
from portico.registry import ModelNotFound, ModelSource, models_dir

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run: weights on their device, its architecture, its tokenizer."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    name: str = ""
    # A vision model's image preprocessing (transformers' image processor of its folder).
    image_processor: Any = None
    # How its dtype and activations were chosen (engine.numerics); None: by the caller.
    numerics: NumericsPath | None = None

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
    """``auto``: bfloat16 on CUDA, float32 on CPU; otherwise the named dtype. The in-process
    benchmarks' ``--dtype``; an engine resolves ``auto`` per CPU (engine.numerics)."""
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


def _renamed(
    cfg: ModelConfig, tensors: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A vision model's tensors under our names (engine/models/llava.py, qwen2_vl.py; a
    Qwen2.5-VL checkpoint is named as a Qwen2-VL one)."""
    qwen2_vl = cfg.architecture in QWEN_VL_ARCHITECTURES
    rename = rename_qwen2_vl_weights if qwen2_vl else rename_llava_weights
    for name, tensor in tensors:
        ours = rename(name)
        if ours is not None:
            yield ours, tensor


def _model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The module that serves ``cfg``: a text model, LLaVA, Qwen2-VL or Qwen2.5-VL."""
    if not cfg.is_multimodal:
        return LlamaForCausalLM
    if cfg.architecture == "Qwen2VLForConditionalGeneration":
        return Qwen2VLForConditionalGeneration
    if cfg.architecture == "Qwen2_5_VLForConditionalGeneration":
        return Qwen25VLForConditionalGeneration
    return LlavaForConditionalGeneration


def _load_hf(folder: Path) -> tuple[ModelConfig, dict[str, Any], PreTrainedTokenizerBase]:
    raw_config = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw_config)
    tensors = _hf_tensors(folder)
    state = _merge_hf(cfg, _renamed(cfg, tensors) if cfg.is_multimodal else tensors)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return cfg, state, tokenizer


# --------------------------------------------------------------------------- dummy weights

# Dummy weights' spread (transformers' initializer_range for Llama): hidden states of the
# magnitudes real checkpoints have, so timings are a real model's. Not a model that answers.
DUMMY_STD = 0.02
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_load_format(load_format: str, source: ModelSource) -> str:
    """The weights' format for ``--load-format`` on ``source``: ``auto`` follows the files;
    ``dummy`` needs a folder with a config.json and a tokenizer (a GGUF file carries its own
    weights: refused); ``safetensors`` and ``gguf`` must match the files. ValueError naming
    the flag otherwise."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"--load-format must be one of {', '.join(LOAD_FORMATS)}; got '{load_format}'"
        )
    path = Path(source.path)
    if load_format == "dummy":
        if source.format == "gguf":
            raise ValueError(
                f"--load-format dummy makes random weights for a Hugging Face folder's "
                f"config.json; '{source.name}' is a GGUF file, which holds its own weights "
                "(use --load-format auto, or a folder with config.json and a tokenizer)"
            )
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"Model '{source.name}': '{path}' has no config.json.")
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            raise ModelNotFound(
                f"Model '{source.name}': --load-format dummy needs a tokenizer in '{path}' "
                f"(one of {', '.join(_TOKENIZER_FILES)})"
            )
        return "dummy"
    actual = "gguf" if source.format == "gguf" else "safetensors"
    if load_format not in ("auto", actual):
        raise ValueError(
            f"--load-format {load_format} does not match model '{source.name}', which is "
            f"{actual} (use --load-format auto)"
        )
    return actual


def _dummy_state(
    model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random weights for every parameter of ``model`` (on the meta device), made on
    ``device`` directly: matrices normal(0, DUMMY_STD), norm weights 1, biases 0 (what a
    freshly initialised transformers Llama holds). The same ``seed`` gives the same weights on
    the same device."""
    generator = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.dim() >= 2 or name.endswith("class_embedding"):
            tensor = torch.empty(param.shape, dtype=dtype, device=device)
            state[name] = tensor.normal_(0.0, DUMMY_STD, generator=generator)
        elif name.endswith(".weight"):  # a 1-D weight is a norm's scale (RMSNorm, LayerNorm)
            state[name] = torch.ones(param.shape, dtype=dtype, device=device)
        else:
            state[name] = torch.zeros(param.shape, dtype=dtype, device=device)
    return state


# --------------------------------------------------------------------------- GGUF


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


_BLOCK_KINDS = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}


def _gguf_blocks(gguf: GGUFFile, cfg: ModelConfig, permuted: bool) -> dict[str, GGUFBlocks]:
    """The linear weights stored as Q4_1/Q8_0 blocks, under our module names (``...qkv_proj``,
    ``lm_head``), with q/k rows unpermuted and q/k/v, gate/up stacked like the dense weights.
    A layer whose parts are stored in other formats is left out (it runs dense)."""

    def blocks(name: str) -> GGUFBlocks | None:
        info = gguf.tensors.get(name)
        kind = _BLOCK_KINDS.get(info.qtype) if info is not None else None
        return GGUFBlocks.from_raw(kind, gguf.raw(name)) if kind else None

    def stacked(parts: list[GGUFBlocks | None]) -> GGUFBlocks | None:
        if any(p is None for p in parts) or len({p.kind for p in parts if p}) != 1:
            return None
        return GGUFBlocks.concat([p for p in parts if p is not None])

    def unpermute(part: GGUFBlocks | None, heads: int) -> GGUFBlocks | None:
        if part is None or not permuted:
            return part
        order = _unpermute_qk(torch.arange(part.scales.shape[0]), heads)
        return part.rows(order)

    found: dict[str, GGUFBlocks | None] = {}
    output = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    found["lm_head"] = blocks(output)
    for i in range(cfg.num_hidden_layers):
        blk, p = f"blk.{i}.", f"model.layers.{i}."
        q = unpermute(blocks(f"{blk}attn_q.weight"), cfg.num_attention_heads)
        k = unpermute(blocks(f"{blk}attn_k.weight"), cfg.num_key_value_heads)
        found[f"{p}self_attn.qkv_proj"] = stacked([q, k, blocks(f"{blk}attn_v.weight")])
        found[f"{p}self_attn.o_proj"] = blocks(f"{blk}attn_output.weight")
        gate_up = [blocks(f"{blk}ffn_gate.weight"), blocks(f"{blk}ffn_up.weight")]
        found[f"{p}mlp.gate_up_proj"] = stacked(gate_up)
        found[f"{p}mlp.down_proj"] = blocks(f"{blk}ffn_down.weight")
    return {name: b for name, b in found.items() if b is not None and b.shape[1] % 32 == 0}


def _load_gguf(
    path: Path, with_blocks: bool = False
) -> tuple[ModelConfig, dict[str, Any], PreTrainedTokenizerBase, dict[str, GGUFBlocks]]:
    gguf = GGUFFile(path)
    tensors = {name: torch.from_numpy(array) for name, array in gguf.iter_tensors()}
    meta = gguf.metadata
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
    found = _gguf_blocks(gguf, cfg, permuted) if with_blocks else {}
    return cfg, state, _gguf_tokenizer(path), found


def _tokenizer_cache_dir(path: Path) -> Path:
    """Where the tokenizer converted from ``path`` is kept, keyed by file identity."""
    import transformers

    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return models_dir().parent / "tokenizers" / f"{path.stem}-{key}"


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file.

    Converting it (transformers parses the whole file again) costs seconds at every engine
    start, so the converted tokenizer is saved once as a Hugging Face tokenizer folder and
    loaded from there afterwards. A cache that cannot be written is skipped.
    """
    cache = _tokenizer_cache_dir(path)
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    staging: Path | None = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, cache)  # atomic: readers see a whole folder or none
    except OSError as exc:  # read-only home, or another process stored it first
        log.debug("tokenizer cache %s not written: %s", cache, exc)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


# --------------------------------------------------------------------------- entry point


def resolve_quantization(spec: str, source: ModelSource, device: torch.device | str) -> str:
    """``auto``: ``gguf`` for a GGUF model on a CPU where the native kernels build, else
    ``none``. ``gguf`` on another kind of source, or on CUDA, is refused with a ValueError;
    so is ``fp8`` on a device where :func:`fp8_unsupported_reason` says it cannot run."""
    if spec not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got '{spec}'")
    on_cpu = torch.device(device).type == "cpu"
    if spec == "auto":
        served = kernels.choose(torch.device(device).type).quantized_linear != "none"
        return "gguf" if source.format == "gguf" and served else "none"
    if spec == "fp8":
        reason = fp8_unsupported_reason(device)
        if reason is not None:
            raise ValueError(
                f"--quantization fp8 cannot run on {torch.device(device).type}: {reason}"
            )
    if spec == "gguf" and (source.format != "gguf" or not on_cpu):
        raise ValueError(
            f"quantization 'gguf' needs a GGUF model on the CPU; '{source.name}' is "
            f"{source.format} on {torch.device(device).type}"
        )
    return spec


def _attach_blocks(
    model: LlamaForCausalLM,
    cfg: ModelConfig,
    found: dict[str, GGUFBlocks],
    int8: bool,
    dtype: torch.dtype,
) -> None:
    """Hand each linear layer (and the LM head) the GGUF file's blocks of its weight, packed
    for the path ``dtype`` and ``int8`` take."""
    for name, blocks in found.items():
        if int8:
            blocks.pack_q8()
        elif dtype == torch.float32:
            blocks.pack_panels()  # every step on one batch invariant kernel (block_linear.py)
        if name == "lm_head":
            if blocks.shape == (cfg.vocab_size, cfg.hidden_size):
                model.lm_head_blocks = blocks
        else:
            module = model.get_submodule(name)
            if isinstance(module, BlockLinear) and blocks.shape == tuple(module.weight.shape):
                module.blocks = blocks
    _panels_on_huge_pages(model)


def _panels_on_huge_pages(model: LlamaForCausalLM) -> None:
    """Every linear's panels (and the LM head's) moved into one huge-page region, in the
    order a step reads them: a step streams them all, and on 4 KB pages it paid a TLB miss
    and a prefetcher restart every 4 KB (engine/kernels/huge_pages.py). Same bytes."""
    owners = [
        m.blocks for m in model.modules() if isinstance(m, BlockLinear) and m.blocks is not None
    ]
    if model.lm_head_blocks is not None:
        owners.append(model.lm_head_blocks)
    packed = [(b, b.panels) for b in owners if b.panels is not None]
    if packed:
        moved = gather_on_huge_pages([panels for _, panels in packed])
        for (blocks, _), panels in zip(packed, moved, strict=True):
            blocks.panels = panels


def _attach_fused_step(model: LlamaForCausalLM, name: str, panels: bool, int8: bool) -> None:
    """The small steps' one native call where it computes the same layers: the int8 one
    (bfloat16 with int8 activations) or the panel one (float32 on the GGUF panels, whose
    Python path then runs its norms through the same native kernel: the same bits)."""
    if panels:
        use_native_norms(model)
    model.fused_step = None
    if int8:
        model.fused_step = FusedDecodeStep.build(model)
    elif panels:
        model.fused_step = FusedPanelStep.build(model)
    if model.fused_step is not None:
        log.info("%s: steps of up to %d tokens run in one native call", name, MAX_ROWS)


def load_model(
    source: ModelSource,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str = "none",
    gguf_activations: str = "exact",
    load_format: str = "auto",
) -> LoadedModel:
    """Load ``source`` (``format`` "hf" or "gguf") as ``dtype`` weights on ``device``.

    ``load_format`` (:func:`check_load_format`): ``dummy`` reads only the folder's config.json
    and tokenizer and fills the weights at random on ``device`` (:func:`_dummy_state`).

    ``quantization`` (:func:`resolve_quantization`): with ``gguf`` the linear layers also keep
    the file's Q4_1/Q8_0 blocks: under float32 every step runs on them, batch invariant; under
    bfloat16 small batches do (:mod:`engine.models.block_linear`).
    ``gguf_activations`` ``int8`` (bfloat16 only) rounds their inputs to int8 per block of 32,
    as llama.cpp does, and lets steps of a few tokens run the whole model in one native call
    (:mod:`engine.models.fused_step`); ``exact`` keeps the products exact.
    Raises :class:`~portico.registry.ModelNotFound` (a ``ValueError``) naming the model when its
    files are missing, and ``ValueError`` for an unsupported architecture.
    """
    path = Path(source.path)
    load_format = check_load_format(load_format, source)
    quantization = resolve_quantization(quantization, source, device)
    if gguf_activations not in GGUF_ACTIVATIONS:
        choices = ", ".join(GGUF_ACTIVATIONS)
        raise ValueError(f"gguf_activations must be one of {choices}; got '{gguf_activations}'")
    int8 = gguf_activations == "int8" and dtype == torch.bfloat16
    found: dict[str, GGUFBlocks] = {}
    if source.format == "gguf":
        if not path.is_file():
            raise ModelNotFound(f"Model '{source.name}': GGUF file '{path}' does not exist.")
        cfg, state, tokenizer, found = _load_gguf(path, with_blocks=quantization == "gguf")
    elif load_format == "dummy":
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        state, tokenizer = {}, AutoTokenizer.from_pretrained(str(path))
    elif source.format == "hf":
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"Model '{source.name}': '{path}' has no config.json.")
        cfg, state, tokenizer = _load_hf(path)
    else:
        raise ValueError(f"Model '{source.name}': unknown format '{source.format}' (hf, gguf)")
    device = torch.device(device)
    with torch.device("meta"):
        model = _model_class(cfg)(cfg)
    if load_format == "dummy":
        state = _dummy_state(model, dtype, device)
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
    if quantization == "fp8":
        kept = quantize_projections(model)
        log.info("%s: projections in fp8 e4m3 (%.1f MiB)", source.name, kept / 2**20)
    _attach_blocks(model, cfg, found, int8, dtype)
    if found:
        log.info("%s: %d weight matrices also kept in GGUF blocks", source.name, len(found))
    packed = model.prepack_weights()
    if packed:
        log.info("%s: %d weight matrices prepacked for oneDNN", source.name, packed)
    panels = bool(found) and not int8 and dtype == torch.float32
    _attach_fused_step(model, source.name, panels, int8)
    image_processor = None
    if cfg.is_multimodal:
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(str(path))
        model.image_processor = image_processor  # the server prepares images with it
    return LoadedModel(
        model=model, config=cfg, tokenizer=tokenizer, name=source.name,
        image_processor=image_processor,
    )  # fmt: skip
