"""How much memory an engine takes, computed from the model's shapes without loading weights.

One sizing rule for two callers: the engine sizes its KV cache with :func:`kv_cache_budget`
(through ``engine.model_runner.num_kv_blocks``), and ``portico plan`` calls the same function
with the device memory it is told about, so a plan and a started engine agree on the number of
KV blocks. Weight bytes follow what ``engine.model_loader.load_model`` keeps resident: every
tensor as dense ``dtype``, plus the GGUF Q4_1/Q8_0 blocks on CPU (``--quantization gguf``),
plus the prepacked copy of each projection for bfloat16 on CPU (oneDNN's bf16 reorder, or float32
where the CPU has no bf16 arithmetic), plus the RoPE tables. With ``--quantization fp8`` the
projections take 1 byte per weight and 4 per output channel instead (and are not prepacked).

With ``--tensor-parallel-size N`` the plan is one rank's: its shard of the projections, the
replicated embedding, norms and head, and a KV cache of its ``KV heads / N``.

Units are bytes throughout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from portico.registry import ModelSource

# The engine keeps this much free per token of one step's budget (max_num_batched_tokens)
# on CUDA for activations: hidden states, q/k/v, the MLP's intermediate, logits.
ACTIVATION_RESERVE_PER_TOKEN = 64 * 1024
# What the CUDA context and the caching allocator's first pools take before any tensor; not
# visible to torch.cuda.mem_get_info's caller as "free" once the engine has started.
CUDA_CONTEXT_BYTES = 512 * 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Resident bytes per weight of a GGUF block kept for the CPU kernels: the packed quants plus
# float32 scales (and mins) per 32 weights (engine.models.block_linear.GGUFBlocks).
GGUF_BLOCK_BYTES_PER_WEIGHT = {"q4_1": 0.5 + 8 / 32, "q8_0": 1.0 + 4 / 32}
# The same blocks repacked for the int8-activation kernels: scales (and mins) in float16, as in
# the GGUF file (csrc/quantized_int8.c).
INT8_PACKED_BYTES_PER_WEIGHT = {"q4_1": 0.5 + 4 / 32, "q8_0": 1.0 + 2 / 32}
# --quantization fp8: e4m3 projections (engine.models.fp8_linear), plus a float32 scale per row
FP8_BYTES_PER_WEIGHT = 1


def kv_block_bytes(
    cfg: ModelConfig, block_size: int, dtype: str, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one KV block takes across all layers: the engine's own function, for the model's
    ``dtype`` given by name (``float32``, ``bfloat16``, ``float16``) and ``--kv-cache-dtype``
    (int8: half of bf16's bytes plus each row's 4-byte scale)."""
    import torch

    from engine.kv_cache_dtype import storage_dtype
    from engine.model_runner import kv_cache_bytes_per_block  # it imports this module

    cache_dtype = storage_dtype(kv_cache_dtype, getattr(torch, dtype))
    return kv_cache_bytes_per_block(cfg, block_size, cache_dtype)


def activation_reserve_bytes(engine_config: EngineConfig) -> int:
    """What the engine leaves free for one step's activations on CUDA."""
    return engine_config.max_num_batched_tokens * ACTIVATION_RESERVE_PER_TOKEN


def kv_cache_budget(
    engine_config: EngineConfig,
    device_type: str,
    free_bytes: int = 0,
    total_bytes: int = 0,
    engine_bytes: int = 0,
) -> int:
    """Bytes the engine gives its KV cache.

    CPU: ``--kv-cache-memory``. CUDA, vLLM's rule: the engine may use
    ``--gpu-memory-utilization`` of the device's ``total_bytes`` in all; its KV cache gets that
    share less what the engine already holds (``engine_bytes``: CUDA context and weights) and
    one step's activation reserve. ``free_bytes`` is what the device has free now (the
    engine's own bytes already taken out): when other processes leave less free than the
    cache and the reserve need, ValueError says so, naming the flag.
    """
    if device_type != "cuda":
        return engine_config.kv_cache_memory_bytes
    share = int(total_bytes * engine_config.gpu_memory_utilization)
    reserve = activation_reserve_bytes(engine_config)
    budget = share - engine_bytes - reserve
    if budget > 0 and budget + reserve > free_bytes:
        others = total_bytes - free_bytes - engine_bytes
        raise ValueError(
            f"--gpu-memory-utilization {engine_config.gpu_memory_utilization:g} gives this "
            f"engine {share / 2**30:.2f} GiB of the GPU's {total_bytes / 2**30:.2f} GiB, but "
            f"other processes hold {others / 2**30:.2f} GiB and only {free_bytes / 2**30:.2f} "
            "GiB are free: lower --gpu-memory-utilization (engines sharing a card split it, "
            "e.g. 0.4 each) or free the device"
        )
    return budget


def cuda_memory(device: object) -> tuple[int, int, int]:
    """``(free, total, engine)`` bytes of a CUDA ``device`` now, for :func:`kv_cache_budget`:
    free counts the caching allocator's reserved but unused bytes (the cache reuses them);
    engine is what this process's tensors hold plus :data:`CUDA_CONTEXT_BYTES`."""
    import torch

    free, total = torch.cuda.mem_get_info(device)  # type: ignore[arg-type]
    allocated = torch.cuda.memory_allocated(device)  # type: ignore[arg-type]
    cached = torch.cuda.memory_reserved(device) - allocated  # type: ignore[arg-type]
    return int(free + cached), int(total), int(allocated + CUDA_CONTEXT_BYTES)


def gpu_share_flags(
    engine_args: Sequence[str], num_engines: int, cuda_available: bool, utilization: float = 0.9
) -> list[str]:
    """``engine_args`` for one of ``num_engines`` engines sharing one CUDA card: with
    ``--gpu-memory-utilization`` set to an even split of ``utilization`` (floored to 0.01),
    where the engines run on CUDA (``--device cuda``, or ``auto``/absent and
    ``cuda_available``) and the flag is not given already. Unchanged otherwise."""
    args = list(engine_args)
    device = "auto"
    for i, word in enumerate(args):
        if word == "--device" and i + 1 < len(args):
            device = args[i + 1]
        elif word.startswith("--device="):
            device = word.split("=", 1)[1]
    on_cuda = device == "cuda" or (device == "auto" and cuda_available)
    given = any(w.split("=")[0] == "--gpu-memory-utilization" for w in args)
    if not on_cuda or given or num_engines < 1:
        return args
    share = math.floor(utilization / num_engines * 100) / 100
    return [*args, "--gpu-memory-utilization", f"{share:g}"]


def num_blocks_in(budget_bytes: int, per_block_bytes: int) -> int:
    """How many KV blocks ``budget_bytes`` holds; ValueError when not one does."""
    blocks = budget_bytes // per_block_bytes
    if blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget_bytes} bytes) holds no block of {per_block_bytes} "
            "bytes; raise --kv-cache-memory or --gpu-memory-utilization"
        )
    return blocks


def activation_peak_bytes(
    cfg: ModelConfig, num_tokens: int, num_seqs: int, dtype_bytes: int
) -> int:
    """An estimate of one step's largest live activations: the residual stream and its norm,
    the fused q/k/v and gate/up outputs of one layer, the attention output, and float32 logits
    for the sampled rows (one per sequence)."""
    q_kv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    per_token = 3 * cfg.hidden_size + q_kv + 3 * cfg.intermediate_size
    return num_tokens * per_token * dtype_bytes + num_seqs * cfg.vocab_size * 4


@dataclass(frozen=True)
class WeightTensor:
    """One stored tensor: its name, element count, and GGUF block kind kept on CPU (or None)."""

    name: str
    numel: int
    block_kind: str | None = None


@dataclass(frozen=True)
class WeightBytes:
    """Resident weight memory, by part."""

    dense: int
    gguf_blocks: int
    prepacked: int
    rope_tables: int

    @property
    def total(self) -> int:
        return self.dense + self.gguf_blocks + self.prepacked + self.rope_tables


def hf_tensors(folder: Path) -> tuple[ModelConfig, list[WeightTensor]]:
    """A Hugging Face folder's config and tensor sizes, read from the safetensors headers."""
    from safetensors import safe_open

    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    tensors = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue  # the loader skips these
                shape = handle.get_slice(name).get_shape()
                tensors.append(WeightTensor(name, math.prod(shape)))
    if not tensors:
        raise ValueError(f"Model folder '{folder}' has no .safetensors weights.")
    return cfg, tensors


def config_tensors(folder: Path) -> tuple[ModelConfig, list[WeightTensor]]:
    """A folder's config and the tensors ``--load-format dummy`` makes for it (no weights
    read: the model's parameters, built on the meta device)."""
    import torch

    from engine.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return cfg, [WeightTensor(name, p.numel()) for name, p in model.named_parameters()]


def gguf_tensors(path: Path) -> tuple[ModelConfig, list[WeightTensor]]:
    """A GGUF file's config and tensor sizes from its header (no tensor is dequantized)."""
    from engine.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    tied = "output.weight" not in gguf.tensors
    vocab = gguf.tensors["token_embd.weight"].shape[0]
    cfg = ModelConfig.from_gguf_metadata(gguf.metadata, vocab_size=vocab, tied=tied)
    tensors = [
        WeightTensor(info.name, math.prod(info.shape), _block_kind(info.name, info, tied))
        for info in gguf.tensors.values()
    ]
    if tied and (embd := gguf.tensors["token_embd.weight"]).qtype.name.lower() in (
        GGUF_BLOCK_BYTES_PER_WEIGHT
    ):
        # the tied head keeps its own blocks of the embedding (the dense weight is shared)
        tensors.append(WeightTensor("lm_head", 0, embd.qtype.name.lower()))
    return cfg, tensors


_BLOCK_TENSORS = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.",
                  "ffn_down.", "output.")  # fmt: skip


def _block_kind(name: str, info: object, tied: bool) -> str | None:
    kind = info.qtype.name.lower()  # type: ignore[attr-defined]
    shape = info.shape  # type: ignore[attr-defined]
    linear = name.endswith(".weight") and any(f".{t}" in f".{name}" for t in _BLOCK_TENSORS)
    if kind not in GGUF_BLOCK_BYTES_PER_WEIGHT or not linear or shape[-1] % 32:
        return None
    return kind


# Weights split over tensor-parallel ranks (HF and GGUF names); the rest is on every rank.
_SPLIT_TENSORS = ("q_proj.", "k_proj.", "v_proj.", "o_proj.weight", "gate_proj.", "up_proj.",
                  "down_proj.weight", "attn_q.", "attn_k.", "attn_v.", "attn_output.weight",
                  "ffn_gate.", "ffn_up.", "ffn_down.weight")  # fmt: skip


def rank_share(tensor: WeightTensor, world_size: int) -> WeightTensor:
    """What one of ``world_size`` tensor-parallel ranks keeps of ``tensor``
    (engine.distributed.sharding: projections split, embedding, norms and head replicated)."""
    if not any(part in tensor.name for part in _SPLIT_TENSORS):
        return tensor
    return WeightTensor(tensor.name, tensor.numel // world_size, tensor.block_kind)


def weight_bytes(
    cfg: ModelConfig,
    tensors: Iterable[WeightTensor],
    dtype_bytes: int,
    *,
    gguf_blocks: bool,
    prepacked_bytes: int,
    int8_packed: bool = False,
    panels: bool = False,
    fp8: bool = False,
) -> WeightBytes:
    """What the loaded model keeps resident (see the module doc). ``prepacked_bytes``: bytes
    per weight of the projections' and head's second copy (0: none). ``int8_packed``: the
    blocks are kept a second time, repacked for the int8-activation kernels (float16 scales;
    counted in ``gguf_blocks``). ``panels``: a second time as the batch invariant kernel's
    panels (float32 on CPU: the same bytes as the blocks; counted in ``gguf_blocks``)."""
    tensors = list(tensors)
    dense = sum(t.numel for t in tensors) * dtype_bytes
    if fp8:  # the projections at 1 byte per weight plus a float32 scale per output channel
        dense -= _projection_weights(cfg) * (dtype_bytes - FP8_BYTES_PER_WEIGHT)
        dense += _projection_outputs(cfg) * 4
    blocks = 0
    if gguf_blocks:
        for t in tensors:
            if t.block_kind is not None:
                numel = t.numel or cfg.vocab_size * cfg.hidden_size
                blocks += int(numel * GGUF_BLOCK_BYTES_PER_WEIGHT[t.block_kind]) * (1 + panels)
                if int8_packed and (numel // cfg.hidden_size) % 64 == 0:
                    blocks += int(numel * INT8_PACKED_BYTES_PER_WEIGHT[t.block_kind])
    packed = 0
    if prepacked_bytes:  # every projection (unless fp8) and the head, once more
        projections = 0 if fp8 else _projection_weights(cfg)
        packed = prepacked_bytes * (projections + cfg.vocab_size * cfg.hidden_size)
    rope = cfg.max_position_embeddings * cfg.head_dim * 4  # cos and sin, float32, d/2 each
    return WeightBytes(dense, blocks, packed, rope)


def _projection_weights(cfg: ModelConfig) -> int:
    """Weights of every layer's q/k/v, o, gate/up and down projections."""
    layer = (
        cfg.hidden_size
        * ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
           + 2 * cfg.intermediate_size)
        + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size
        + cfg.intermediate_size * cfg.hidden_size
    )  # fmt: skip
    return cfg.num_hidden_layers * layer


def _projection_outputs(cfg: ModelConfig) -> int:
    """Output channels of those projections (one fp8 scale each)."""
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    return cfg.num_hidden_layers * (qkv + 2 * cfg.hidden_size + 2 * cfg.intermediate_size)


@dataclass(frozen=True)
class MemoryPlan:
    """What one engine with ``engine_config`` takes on a device of ``memory_bytes``, and the
    flags that make it fit. ``num_blocks`` is the engine's own count for the same flags."""

    engine_config: EngineConfig
    model_path: str
    model_format: str
    model_config: ModelConfig
    device_type: str
    dtype: str
    kv_cache_dtype: str  # what the cache stores (--kv-cache-dtype, auto resolved by the numerics)
    quantization: str
    memory_bytes: int
    max_model_len: int
    weights: WeightBytes
    kv_block_bytes: int
    kv_budget_bytes: int
    num_blocks: int
    activation_reserve_bytes: int  # kept free by the engine (CUDA)
    activation_peak_bytes: int  # estimated from the model's shapes
    cuda_context_bytes: int
    outside_share_bytes: int  # (1 - gpu_memory_utilization) of the device: not this engine's
    used_bytes: int  # held on the device by other processes when the plan was made
    swap_bytes: int  # host memory for swapped-out blocks (--preemption-mode swap)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_block_bytes // self.engine_config.block_size

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.engine_config.block_size)

    @property
    def kv_bytes_per_seq(self) -> int:
        return self.blocks_per_seq * self.kv_block_bytes

    @property
    def full_length_seqs(self) -> int:
        """Sequences of max_model_len tokens the cache holds at once."""
        return self.num_blocks // self.blocks_per_seq

    @property
    def total_bytes(self) -> int:
        """Device memory the engine needs (on CPU, host memory, swap space included)."""
        if self.device_type == "cuda":
            used = self.cuda_context_bytes + self.weights.total + self.activation_reserve_bytes
            return used + self.num_blocks * self.kv_block_bytes
        kv = self.num_blocks * self.kv_block_bytes
        return self.weights.total + kv + self.activation_peak_bytes + self.swap_bytes

    @property
    def fits(self) -> bool:
        if self.device_type == "cuda":
            share = self.memory_bytes - self.outside_share_bytes
            room = self.memory_bytes - self.used_bytes
            return self.num_blocks >= 1 and self.total_bytes <= min(share, room)
        return self.num_blocks >= 1 and self.total_bytes <= self.memory_bytes


def plan(
    engine_config: EngineConfig, memory_bytes: int | None = None, used_bytes: int | None = None
) -> MemoryPlan:
    """Plan ``engine_config`` without loading a weight (``memory_bytes`` None: what this
    machine has: CUDA's total device memory, or the host's available memory). ``used_bytes``:
    what other processes hold on the CUDA device (None: what this machine's device has in use
    when ``memory_bytes`` is None, else 0); the engine's own sizing meets the same numbers."""
    import torch

    from engine.model_loader import resolve_quantization
    from engine.numerics import resolve_numerics
    from portico.registry import resolve

    source = resolve(engine_config.model)
    device_type = engine_config.device
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_type)
    quantization = resolve_quantization(engine_config.quantization, source, device)
    numerics = resolve_numerics(
        engine_config.dtype, engine_config.gguf_activations, device, quantization == "gguf"
    )
    dtype = numerics.dtype
    dtype_bytes = DTYPE_BYTES[dtype]
    cfg, tensors = _rank_tensors(engine_config, source)
    max_model_len = engine_config.max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's context length "
            f"({cfg.max_position_embeddings})"
        )
    on_cpu = device_type == "cpu"
    weights = weight_bytes(
        cfg,
        tensors,
        dtype_bytes,
        gguf_blocks=quantization == "gguf",
        prepacked_bytes=_prepacked_bytes_per_weight() if on_cpu and dtype == "bfloat16" else 0,
        int8_packed=numerics.gguf_activations == "int8" and _has_int8_kernels(),
        panels=on_cpu and dtype == "float32" and quantization == "gguf",
        fp8=quantization == "fp8",
    )
    memory, used = _device_memory(device_type, memory_bytes, used_bytes)
    kv_dtype = numerics.kv_cache_dtype(engine_config.kv_cache_dtype)
    per_block = kv_block_bytes(cfg, engine_config.block_size, dtype, kv_dtype)
    context = 0 if on_cpu else CUDA_CONTEXT_BYTES
    free_after_weights = memory - used - context - weights.total
    budget = kv_cache_budget(
        engine_config, device_type, free_after_weights, memory, context + weights.total
    )
    override = engine_config.num_gpu_blocks_override
    blocks = override if override is not None else max(budget // per_block, 0)
    swapping = engine_config.preemption_mode == "swap"
    return MemoryPlan(
        engine_config=engine_config,
        model_path=str(source.path),
        model_format=source.format,
        model_config=cfg,
        device_type=device_type,
        dtype=dtype,
        kv_cache_dtype=dtype if kv_dtype == "auto" else kv_dtype,
        quantization=quantization,
        memory_bytes=memory,
        max_model_len=max_model_len,
        weights=weights,
        kv_block_bytes=per_block,
        kv_budget_bytes=budget,
        num_blocks=blocks,
        activation_reserve_bytes=0 if on_cpu else activation_reserve_bytes(engine_config),
        activation_peak_bytes=activation_peak_bytes(
            cfg, engine_config.max_num_batched_tokens, engine_config.max_num_seqs, dtype_bytes
        ),
        cuda_context_bytes=context,
        outside_share_bytes=0
        if on_cpu
        else memory - int(memory * engine_config.gpu_memory_utilization),
        used_bytes=used,
        swap_bytes=engine_config.swap_space_bytes // per_block * per_block if swapping else 0,
    )


def _rank_tensors(
    engine_config: EngineConfig, source: ModelSource
) -> tuple[ModelConfig, list[WeightTensor]]:
    """The model's config and tensors as one rank holds them: read from the config.json alone
    for ``--load-format dummy``, else from the GGUF or safetensors headers; with tensor
    parallelism, the rank's heads, MLP slice and share of the split weights."""
    from engine.model_loader import check_load_format

    if check_load_format(engine_config.load_format, source) == "dummy":
        cfg, tensors = config_tensors(Path(source.path))
    elif source.format == "gguf":
        cfg, tensors = gguf_tensors(Path(source.path))
    else:
        cfg, tensors = hf_tensors(Path(source.path))
    world = engine_config.tensor_parallel_size
    if world > 1:
        from engine.distributed.sharding import shard_config

        cfg = shard_config(cfg, world)
        tensors = [rank_share(t, world) for t in tensors]
    return cfg, tensors


def _device_memory(
    device_type: str, memory_bytes: int | None, used_bytes: int | None
) -> tuple[int, int]:
    """The plan's device size and what others hold there (see :func:`plan`)."""
    if memory_bytes is None:
        memory, in_use = _machine_memory(device_type)
    else:
        memory, in_use = memory_bytes, 0
    if device_type == "cpu":
        return memory, 0
    return memory, used_bytes if used_bytes is not None else in_use


def _has_int8_kernels() -> bool:
    from engine.kernels import cpu

    return cpu.int8_available()


def _prepacked_bytes_per_weight() -> int:
    """Bytes of each bf16 projection's second copy on this CPU (engine.kernels.
    prepack_linear_weight): 4 for the float32 copy where bf16 arithmetic is not native, 2 for
    oneDNN's reorder where torch can make it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), else none."""
    import torch

    from engine.kernels import cpu

    if not cpu.bf16_matmul_native():
        return 4
    mkldnn = torch.backends.mkldnn.is_available()
    return 2 if mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported() else 0


def _machine_memory(device_type: str) -> tuple[int, int]:
    """This machine's memory for ``device_type`` and what is in use there: CUDA's total and
    used (total - free) device bytes; the host's available memory (in use: 0) for a CPU."""
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("no CUDA device here: give the device's size with --memory")
        free, total = torch.cuda.mem_get_info()
        return int(total), int(total - free)
    import psutil

    return int(psutil.virtual_memory().available), 0
