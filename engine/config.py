"""Engine flags: one dataclass, vLLM's flag names, shared by `portico engine` and `LLM(...)`."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, fields
from typing import Any

from engine.kv_cache_dtype import KV_CACHE_DTYPES
from engine.multimodal import parse_limit_mm_per_prompt
from engine.pooling_params import TASKS, load_pooler_config
from engine.spec_decode.config import SpeculativeConfig
from engine.structured_output.limits import LIMIT_HELP, ConstraintLimits, limit_flag
from portico.contract import FAIR_CONTENDED_PREFILL_TOKENS, FAIR_SHORT_PREFILL_TOKENS

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# --max-num-batched-tokens 0 by device type: CUDA keeps vLLM's serving default; on a CPU a
# 2048-token step takes seconds, which every other request waits out (measured: 512 tokens
# per step cost no more per token than 2048 on smollm2-135m, docs/benchmarks.md)
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


def _device_type(device: str) -> str:
    """``cpu`` or ``cuda`` for ``--device`` (``auto``: cuda when torch sees one)."""
    if device != "auto":
        return device
    import torch  # only here: the config is read where torch may not be loaded yet

    return "cuda" if torch.cuda.is_available() else "cpu"


PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fair", "fcfs", "priority")  # engine/scheduling_policy.py
# fp8: e4m3 projections with per-channel scales, per-token activation scales (vLLM's online
# fp8; engine/models/fp8_linear.py)
QUANTIZATIONS = ("auto", "none", "gguf", "fp8")
# vLLM's --load-format: auto (by the model's files), safetensors (a Hugging Face folder), gguf
# (a .gguf file), dummy (random weights of a folder's config.json shape: benchmarks without
# weights; engine/model_loader.py)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
GGUF_ACTIVATIONS = ("int8", "exact")

_MEMORY_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: str | int, flag: str = "--kv-cache-memory") -> int:
    """Bytes from ``2GiB``, ``512MiB``, ``1.5GB``, ``4g`` or a plain integer of bytes.

    Binary units (KiB, MiB, GiB, TiB, and the bare K, M, G, T) are powers of 1024, decimal
    ones (KB, MB, GB, TB) powers of 1000. Raises ValueError naming ``flag``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{flag} must be a size such as 2GiB, got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        match = _MEMORY_RE.match(str(value))
        if match is None or match.group(2).lower() not in _MEMORY_UNITS:
            raise ValueError(f"{flag} must be a size such as 2GiB or 512MiB, got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    num_bytes = int(number * _MEMORY_UNITS[unit])
    if num_bytes <= 0:
        raise ValueError(f"{flag} must be positive, got {value!r}")
    return num_bytes


@dataclass
class EngineConfig:
    """Every engine flag, with vLLM's names (``--max-num-seqs`` is ``max_num_seqs``).

    Validated at construction: a bad value raises ValueError naming the flag. The model's
    own numbers (layers, heads, context length) live in ``ModelConfig``; ``max_model_len``
    here is only the user's cap (None: the model's).
    """

    model: str = "smollm2-135m"
    served_model_name: str | None = None  # None: the model spec as given
    # auto: bfloat16 on CUDA; on CPU float32 on the GGUF blocks, batch invariant
    # (engine/numerics.py, docs/numerics.md)
    dtype: str = "auto"
    # Refuse to start unless the resolved numerics are batch invariant (docs/numerics.md): on
    # CPU the default is; bf16 opt-ins, dense models and CUDA are not (no such path there yet).
    batch_invariant: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu
    # auto: a GGUF model on CPU keeps its Q4_1/Q8_0 blocks for small batches ("gguf")
    quantization: str = "auto"
    # int8: GGUF block linears round bf16 inputs to int8 per 32 values (llama.cpp's way) and
    # small steps run the whole model in one native call; exact: exact products
    gguf_activations: str = "int8"
    load_format: str = "auto"  # LOAD_FORMATS; dummy: random weights, any config.json's shape
    block_size: int = 16
    # Images a prompt may carry (vision models): vLLM's "image=N" (engine/multimodal.py)
    limit_mm_per_prompt: str = "image=4"
    max_num_seqs: int = 64
    # 0: by device, DEFAULT_BATCHED_TOKENS (a CPU step's time grows with its tokens; 512 is no
    # slower per token there and keeps a step near half a second: docs/benchmarks.md)
    max_num_batched_tokens: int = 0
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    # Which waiting request runs next: fair (per-tenant virtual token counters, interactive
    # before batch), fcfs (arrival order) or priority (vLLM's priority field, then arrival).
    scheduling_policy: str = "fair"
    # fair: a request waiting this long is served next whatever its tenant's counter or class.
    fair_max_wait_s: float = 30.0
    # fair: while two tenants have each had work within the window, a step carries at most
    # this many prefill tokens besides its decodes (0: never capped), so another tenant's new
    # request waits at most one short step. The window is long (a tenant that comes back
    # within it finds short steps, not one full step of the other's prefill in flight: issue
    # 43's first request). Measured trade-off: docs/benchmarks.md.
    fair_contended_prefill_tokens: int = FAIR_CONTENDED_PREFILL_TOKENS
    fair_contention_window_s: float = 300.0
    # fair: the least-served flows' prompts, when they need at most this many tokens in all,
    # run in a step without the other flows' prefill (0: off), so a newcomer's first token
    # costs a short step, not a full one (FairPolicy.short_step).
    fair_short_prefill_tokens: int = FAIR_SHORT_PREFILL_TOKENS
    # fair: while interactive requests have been around within the contention window, batch
    # requests take at most this many prefill tokens a step (0: no limit): batches in the gaps.
    fair_batch_prefill_tokens: int = 64
    fair_batch_window_s: float = 2.0
    # KV cache element type (vLLM's --kv-cache-dtype): auto = float16 on the default CPU path
    # (engine.numerics), else the model's dtype; int8 rows carry
    # their own scale; fp8_e4m3 runs the PyTorch reference (engine/kv_cache_dtype.py).
    kv_cache_dtype: str = "auto"
    swap_space: float = 1.0  # GiB of CPU memory for swapped-out KV blocks (mode "swap")
    kv_cache_memory: str | int = "2GiB"  # KV budget on CPU
    # vLLM's meaning: the fraction of the card's total memory this engine may use, weights,
    # CUDA context, activations and KV cache included (two engines at 0.4 share one card)
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    enforce_eager: bool = False  # vLLM's flag: no CUDA graphs for decode steps (engine.cuda_graphs)
    # vLLM's flag: schedule step N+1 before reading step N's tokens (engine.async_scheduling)
    async_scheduling: bool = False
    num_gpu_blocks_override: int | None = None  # fixes the pool size (tests force tiny pools)
    # Multi-LoRA (vLLM's names and defaults): adapters as "name=path" or vLLM's JSON form.
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1  # adapters one step can mix (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in memory (LRU); None: max_loras
    allow_runtime_lora_updating: bool = False  # or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
    # Ranks one model is split over (engine.distributed): heads and MLP columns per rank.
    tensor_parallel_size: int = 1
    # What the server answers (vLLM's --task): auto = generation and embeddings, generate =
    # no /v1/embeddings, embed = only /v1/embeddings (engine/pooling.py).
    task: str = "auto"
    pooler_config: str | None = None  # vLLM's JSON: pooling_type, normalize, matryoshka dims
    # Speculative decoding: vLLM's JSON ({"method": "ngram", ...} or {"model": ..., ...}),
    # its dict, or the parsed SpeculativeConfig; None: off. Parsed at construction.
    speculative_config: str | dict[str, Any] | SpeculativeConfig | None = None
    # Structured outputs: limits on a request's constraint, checked before it compiles, and
    # the compile pool (engine/structured_output/limits.py, docs/structured-outputs.md).
    structured_outputs_max_bytes: int = ConstraintLimits.max_bytes
    structured_outputs_max_depth: int = ConstraintLimits.max_depth
    structured_outputs_max_properties: int = ConstraintLimits.max_properties
    structured_outputs_max_enum_values: int = ConstraintLimits.max_enum_values
    structured_outputs_max_nodes: int = ConstraintLimits.max_nodes
    structured_outputs_max_repeat: int = ConstraintLimits.max_repeat
    structured_outputs_max_tools: int = ConstraintLimits.max_tools
    structured_outputs_max_tools_bytes: int = ConstraintLimits.max_tools_bytes
    structured_outputs_compile_timeout: float = ConstraintLimits.compile_timeout
    structured_outputs_compile_workers: int = ConstraintLimits.compile_workers
    structured_outputs_compile_per_tenant: int = ConstraintLimits.compile_per_tenant
    structured_outputs_max_mask_ms: float = ConstraintLimits.max_mask_ms

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("--model must be a model alias, folder or .gguf path")
        _check_choice("--dtype", self.dtype, DTYPES)
        _check_choice("--device", self.device, DEVICES)
        _check_choice("--quantization", self.quantization, QUANTIZATIONS)
        _check_choice("--gguf-activations", self.gguf_activations, GGUF_ACTIVATIONS)
        _check_choice("--load-format", self.load_format, LOAD_FORMATS)
        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        _check_choice("--preemption-mode", self.preemption_mode, PREEMPTION_MODES)
        _check_choice("--scheduling-policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _check_number("--fair-max-wait-s", self.fair_max_wait_s, 0.0, math.inf)
        _check_int("--fair-contended-prefill-tokens", self.fair_contended_prefill_tokens, 0)
        _check_number("--fair-contention-window-s", self.fair_contention_window_s, 0.0, math.inf)
        _check_int("--fair-short-prefill-tokens", self.fair_short_prefill_tokens, 0)
        _check_int("--fair-batch-prefill-tokens", self.fair_batch_prefill_tokens, 0)
        _check_number("--fair-batch-window-s", self.fair_batch_window_s, 0.0, math.inf)
        _check_choice("--task", self.task, TASKS)
        if self.pooler_config is not None:
            load_pooler_config(None, self.pooler_config)  # ValueError naming the flag
        _check_int("--block-size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        _check_int("--max-num-seqs", self.max_num_seqs, 1)
        _check_int("--max-num-batched-tokens", self.max_num_batched_tokens, 0)
        if not self.max_num_batched_tokens:
            self.max_num_batched_tokens = DEFAULT_BATCHED_TOKENS[_device_type(self.device)]
        if self.max_model_len is not None:
            _check_int("--max-model-len", self.max_model_len, 1)
        if self.num_gpu_blocks_override is not None:
            _check_int("--num-gpu-blocks-override", self.num_gpu_blocks_override, 1)
        _check_int("--seed", self.seed, 0)
        _check_choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_number("--swap-space", self.swap_space, 0.0, math.inf)
        _check_number("--gpu-memory-utilization", self.gpu_memory_utilization, 0.0, 1.0)
        if self.gpu_memory_utilization == 0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1], got 0")
        parse_memory(self.kv_cache_memory)
        _check_int("--max-loras", self.max_loras, 1)
        _check_int("--max-lora-rank", self.max_lora_rank, 1)
        if self.max_cpu_loras is not None:
            _check_int("--max-cpu-loras", self.max_cpu_loras, 1)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(
                    f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras "
                    f"({self.max_loras})"
                )
        self.lora_modules = tuple(self.lora_modules or ())
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = [m.name for m in self.lora_module_specs]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names must be unique, got {names}")
        _check_int("--tensor-parallel-size", self.tensor_parallel_size, 1)
        if self.tensor_parallel_size > 1 and self.enable_lora:
            raise ValueError("--enable-lora is not supported with --tensor-parallel-size > 1")
        if self.tensor_parallel_size > 1 and self.batch_invariant:
            # the ranks shard dense weights and all-reduce partial sums in their own order
            raise ValueError("--batch-invariant is not supported with --tensor-parallel-size > 1")
        if self.tensor_parallel_size > 1 and self.quantization == "fp8":
            # the ranks shard dense weights (engine/distributed/sharding.py); fp8 ones are not
            raise ValueError("--quantization fp8 is not supported with --tensor-parallel-size > 1")
        for name in LIMIT_HELP:
            try:
                ConstraintLimits(**{name: getattr(self, f"structured_outputs_{name}")})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{limit_flag(name)}: {exc}") from None
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            # the worker ranks take each step's tokens from the host (engine/distributed)
            raise ValueError("--async-scheduling is not supported with --tensor-parallel-size > 1")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "--speculative-config is not supported with --tensor-parallel-size > 1"
                )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``--speculative-config`` parsed, or None when speculation is off."""
        spec = self.speculative_config
        return spec if isinstance(spec, SpeculativeConfig) else None

    @property
    def constraint_limits(self) -> ConstraintLimits:
        """The ``--structured-outputs-*`` flags as one object."""
        return ConstraintLimits(
            **{name: getattr(self, f"structured_outputs_{name}") for name in LIMIT_HELP}
        )

    @property
    def lora_module_specs(self) -> list[LoRAModuleSpec]:
        """``--lora-modules`` parsed (ValueError naming the flag on a bad entry)."""
        return [LoRAModuleSpec.parse(text) for text in self.lora_modules]

    @property
    def cpu_lora_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def kv_cache_memory_bytes(self) -> int:
        return parse_memory(self.kv_cache_memory)

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * 2**30)

    @property
    def model_name(self) -> str:
        """The name clients use in ``"model": ...``."""
        return self.served_model_name or self.model

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add every engine flag to ``parser`` (defaults are EngineConfig's)."""
        d = EngineConfig()
        g = parser.add_argument_group("engine")
        _add_model_args(g, d)
        _add_scheduling_args(g, d)
        _add_memory_and_task_args(g, d)
        _add_lora_args(parser.add_argument_group("LoRA adapters"), d)
        _add_extension_args(parser, d)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """Build from parsed flags; attributes the namespace lacks keep their defaults."""
        values: dict[str, Any] = {
            f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)
        }
        return cls(**values)


@dataclass(frozen=True)
class LoRAModuleSpec:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON object."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModuleSpec:
        if text.lstrip().startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules: invalid JSON {text!r}: {exc}") from None
            if not isinstance(obj, dict) or not all(
                isinstance(obj.get(k), str) and obj.get(k) for k in ("name", "path")
            ):
                raise ValueError(f'--lora-modules JSON needs "name" and "path" strings: {text!r}')
            base = obj.get("base_model_name")
            return cls(obj["name"], obj["path"], base if isinstance(base, str) else None)
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entries are name=path, got {text!r}")
        return cls(name, path)


def _check_choice(flag: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")


def _check_int(flag: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def _check_number(flag: str, value: Any, low: float, high: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or math.isnan(value) or not low <= value <= high:
        raise ValueError(f"{flag} must be a number in [{low:g}, {high:g}], got {value!r}")


def _add_model_args(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """The model, its numbers and its weights' format."""
    g.add_argument("--model", default=d.model, help="model alias, HF folder or .gguf file")
    g.add_argument("--served-model-name", default=None, help="name clients send as 'model'")
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=DTYPES,
        help="auto: bfloat16 on CUDA; on CPU float32 on a GGUF model's blocks, batch "
        "invariant: a request's tokens do not depend on the load (logged at start, shown "
        "in /v1/models); bfloat16: faster on CPUs with VNNI/bf16 units, not invariant",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="CPU: refuse to start unless the numerics are batch invariant (the default on "
        "a GGUF model is); CUDA: run the batch invariant Triton matmuls, norms and attention, "
        "eager (docs/numerics.md)",
    )
    g.add_argument("--device", default=d.device, choices=DEVICES)
    g.add_argument(
        "--quantization",
        default=d.quantization,
        choices=QUANTIZATIONS,
        help="gguf: run small batches on a GGUF model's own Q4_1/Q8_0 blocks "
        "(CPU); fp8: the layers' projections in float8 e4m3 with per-channel scales, "
        "inputs scaled per token, torch's scaled matmul (CUDA 8.9+, or a CPU whose torch "
        "has it: slow there); auto: gguf when the model is GGUF and the device the CPU",
    )
    g.add_argument(
        "--gguf-activations",
        default=d.gguf_activations,
        choices=GGUF_ACTIVATIONS,
        help="int8 (bfloat16 only): round the GGUF block linears' inputs to int8 per 32 "
        "values, as llama.cpp does, and run steps of a few tokens in one native call "
        "(faster single-stream decode; not bit-exact); exact: exact products",
    )
    g.add_argument(
        "--load-format",
        default=d.load_format,
        choices=LOAD_FORMATS,
        help="auto: by the model's files; dummy: random weights in the shape of a folder's "
        "config.json (its tokenizer too), to benchmark a shape without its weights",
    )


def _add_scheduling_args(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """Blocks, the step's budgets, prefix caching, preemption and the waiting-queue policy."""
    bool_flag = argparse.BooleanOptionalAction
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--limit-mm-per-prompt", default=d.limit_mm_per_prompt,
                   help='most images per prompt on a vision model: image=N (or {"image": '
                   'N}); default image=4')  # fmt: skip
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most requests running at once")  # fmt: skip
    g.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="token budget of one step (default 0: 512 on CPU, 2048 on "
                   "CUDA)")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length cap (default: the model's)")  # fmt: skip
    g.add_argument("--enable-prefix-caching", action=bool_flag, default=True)
    g.add_argument("--enable-chunked-prefill", action=bool_flag, default=True)
    g.add_argument("--preemption-mode", default=d.preemption_mode, choices=PREEMPTION_MODES)
    g.add_argument(
        "--scheduling-policy",
        default=d.scheduling_policy,
        choices=SCHEDULING_POLICIES,
        help="fair: tenants (x-portico-tenant) share by weight, interactive before batch; "
        "fcfs: arrival order; priority: the request's priority (lower first), then arrival",
    )
    g.add_argument("--fair-max-wait-s", type=float, default=d.fair_max_wait_s,
                   help="fair: a request waiting this many seconds runs next (no "
                   "starvation)")  # fmt: skip
    g.add_argument("--fair-contended-prefill-tokens", type=int,
                   default=d.fair_contended_prefill_tokens,
                   help="fair: while two or more tenants have work, a step carries at most "
                   "this many prefill tokens besides its decodes, so a tenant's new request "
                   "waits at most one short step (0: no cap)")  # fmt: skip
    g.add_argument("--fair-contention-window-s", type=float,
                   default=d.fair_contention_window_s,
                   help="fair: the step cap holds while two or more tenants have each "
                   "had a request running or waiting within this many seconds")  # fmt: skip
    g.add_argument("--fair-short-prefill-tokens", type=int,
                   default=d.fair_short_prefill_tokens,
                   help="fair: the least-served tenants' prompts, when they need at most "
                   "this many tokens in all, run in a step without the others' prefill "
                   "(0: off)")  # fmt: skip
    g.add_argument("--fair-batch-prefill-tokens", type=int,
                   default=d.fair_batch_prefill_tokens,
                   help="fair: while interactive requests have had work within "
                   "--fair-batch-window-s, batch-class requests take at most this many prefill "
                   "tokens a step (0: no limit)")  # fmt: skip
    g.add_argument("--fair-batch-window-s", type=float, default=d.fair_batch_window_s,
                   help="fair: how long the batch limit stays after the last interactive "
                   "request had work")  # fmt: skip
    g.add_argument("--swap-space", type=float, default=d.swap_space,
                   help="GiB of CPU memory for swapped-out KV blocks")  # fmt: skip


def _add_memory_and_task_args(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """The KV cache's type and budget, the device's memory, parallelism and the task."""
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="KV cache element type: auto (float16 on the default CPU path, --dtype auto on "
        "GGUF blocks; elsewhere the model's dtype), float16 (under float32: half the bytes, "
        "each value rounded once when written), float32, int8 (per token and head "
        "scales: ~half of bf16's bytes, so ~2x the blocks; not bit-identical), fp8_e4m3 "
        "(PyTorch reference only: slow)",
    )
    g.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                   help="KV cache budget on CPU, e.g. 2GiB")  # fmt: skip
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="fraction of the GPU's total memory this engine may use, weights and KV cache "
        "included (vLLM's meaning: two engines at 0.4 share one card)",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly, without CUDA graphs")  # fmt: skip
    g.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule and launch step N+1 before reading step N's tokens (the same "
        "tokens; steps needing N's tokens on the host run synchronously)",
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="fix the number of KV blocks")  # fmt: skip
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model over this many ranks (worker processes; gloo on CPU, "
        "NCCL on CUDA with one GPU per rank); heads must divide evenly",
    )
    g.add_argument("--task", default=d.task, choices=TASKS,
                   help="auto: generation, /v1/embeddings, /v1/score and /v1/rerank; "
                   "generate: generation only; embed: embeddings, score and rerank only "
                   "(a cross-encoder checkpoint serves only score and rerank)")  # fmt: skip
    g.add_argument(
        "--pooler-config",
        "--override-pooler-config",
        dest="pooler_config",
        default=None,
        help='embedding pooling as JSON, e.g. \'{"pooling_type": "MEAN", "normalize": '
        "true}' (default: the model's sentence-transformers files, else LAST, normalised)",
    )


def _add_lora_args(lora: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """Serving LoRA adapters."""
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=(),
        metavar="NAME=PATH",
        help='adapters to serve: name=path or JSON {"name","path","base_model_name"}',
    )
    lora.add_argument("--max-loras", type=int, default=d.max_loras,
                      help="adapters one batch can mix")  # fmt: skip
    lora.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank)
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in memory, LRU beyond (default: --max-loras)",
    )
    lora.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(also VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )


def _add_extension_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """Structured outputs' limits and speculative decoding."""
    limits = parser.add_argument_group("structured outputs")
    for name, text in LIMIT_HELP.items():
        default = getattr(d, f"structured_outputs_{name}")
        limits.add_argument(limit_flag(name), type=type(default), default=default,
                            help=f"{text} (default {default:g})")  # fmt: skip

    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4} or {"model": DRAFT, "num_speculative_tokens": 4}; '
        '"disable_by_batch_size": N turns it off above N running requests',
    )
