"""``portico plan``: will this model fit, and with which flags? Answered before any weight loads.

Takes the flags of ``portico engine`` (vLLM's names) plus ``--memory``, reads the model's
shapes from its config.json/safetensors headers or its GGUF header, and sizes weights, the KV
cache (per token, per sequence, in blocks: the engine's own rule, ``engine.memory_plan``), one
step's activations and the reserves. It prints the engine flags that make the model fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.memory_plan import MemoryPlan

MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.config import EngineConfig

    EngineConfig.add_cli_args(parser)
    g = parser.add_argument_group("plan")
    g.add_argument(
        "--memory",
        default=None,
        metavar="BYTES",
        help="memory of the device to plan for, e.g. 80GiB (default: this machine's GPU, "
        "or the host's available memory for --device cpu)",
    )
    g.add_argument(
        "--memory-used",
        default=None,
        metavar="BYTES",
        help="CUDA: memory other processes hold on the device, e.g. 30GiB (default: what this "
        "machine's GPU has in use, or 0 with --memory)",
    )
    g.add_argument("--json", action="store_true", help="print the plan as JSON")


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", MIB), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


def _flag_size(num_bytes: int) -> str:
    """``num_bytes`` exactly, in the largest binary unit that divides it."""
    for unit, scale in (("GiB", 2**30), ("MiB", MIB), ("KiB", 2**10)):
        if num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


def recommend(p: MemoryPlan) -> tuple[list[str], list[str]]:
    """The engine flags that fit the plan's memory, and notes on what they trade away.

    The goal is a cache that holds ``--max-num-seqs`` sequences of ``--max-model-len`` tokens
    at once (no preemption at full load); failing that, as many full-length sequences as fit;
    failing that, a shorter context for one sequence.
    """
    cfg = p.engine_config
    flags = ["--max-model-len", str(p.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.load_format != "auto":
        flags += ["--load-format", cfg.load_format]
    if cfg.kv_cache_dtype != "auto":  # the blocks were counted in it
        flags += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    notes: list[str] = []
    wanted_blocks = cfg.max_num_seqs * p.blocks_per_seq
    if p.device_type == "cuda":
        flags += ["--device", "cuda", "--gpu-memory-utilization", f"{cfg.gpu_memory_utilization:g}"]
        available_blocks = p.num_blocks
    else:
        flags += ["--device", "cpu"]
        room = p.memory_bytes - p.weights.total - p.activation_peak_bytes - p.swap_bytes
        available_blocks = max(room // p.kv_block_bytes, 0)
        kv_blocks = min(wanted_blocks, available_blocks)
        if kv_blocks >= 1:
            flags += ["--kv-cache-memory", _flag_size(kv_blocks * p.kv_block_bytes)]
    if available_blocks >= wanted_blocks:
        return flags, notes
    if available_blocks < 1:
        notes.append("the weights alone do not leave room for one KV block: use a smaller model, "
                     "a narrower --dtype or a larger device")  # fmt: skip
        return [], notes
    seqs = available_blocks // p.blocks_per_seq
    if seqs >= 1:
        flags[flags.index("--max-num-seqs") + 1] = str(seqs)
        notes.append(
            f"only {seqs} sequence(s) of {p.max_model_len} tokens fit at once: --max-num-seqs "
            f"{seqs} (or keep {cfg.max_num_seqs} and let the scheduler preempt under load)"
        )
    else:
        length = available_blocks * cfg.block_size
        flags[flags.index("--max-model-len") + 1] = str(length)
        flags[flags.index("--max-num-seqs") + 1] = "1"
        notes.append(f"not one sequence of {p.max_model_len} tokens fits: --max-model-len {length}")
    return flags, notes


def _kv_dtype(p: MemoryPlan) -> str:
    """The cache's element type as the plan counts it (``auto`` named as what it resolves to)."""
    name = p.engine_config.kv_cache_dtype
    return f"--kv-cache-dtype {name}" + (f": {p.kv_cache_dtype}" if name == "auto" else "")


def _rows(p: MemoryPlan) -> list[tuple[str, str]]:
    cfg, m = p.engine_config, p.model_config
    w = p.weights
    rows = [
        (
            "model",
            f"{p.model_path} ({p.model_format}, {m.num_hidden_layers} layers, "
            f"{m.num_key_value_heads} KV heads x {m.head_dim})",
        ),  # fmt: skip
        ("device / dtype", f"{p.device_type} / {p.dtype} (quantization {p.quantization})"),
        *(
            [("tensor parallel", f"{cfg.tensor_parallel_size} ranks: every figure is per rank")]
            if cfg.tensor_parallel_size > 1
            else []
        ),
        (
            "weights",
            f"{_size(w.total)}  (dense {_size(w.dense)}, GGUF blocks "
            f"{_size(w.gguf_blocks)}, prepacked {_size(w.prepacked)}, "
            f"RoPE {_size(w.rope_tables)})",
        ),  # fmt: skip
        ("KV cache per token", f"{_size(p.kv_bytes_per_token)}  ({_kv_dtype(p)})"),
        (
            "KV cache per sequence",
            f"{_size(p.kv_bytes_per_seq)}  ({p.max_model_len} tokens, "
            f"{p.blocks_per_seq} blocks of {cfg.block_size})",
        ),  # fmt: skip
        (
            "KV cache",
            f"{_size(p.num_blocks * p.kv_block_bytes)}  ({p.num_blocks} blocks: "
            f"{p.full_length_seqs} full-length sequences at once)",
        ),  # fmt: skip
        (
            "activation peak",
            f"{_size(p.activation_peak_bytes)} estimated "
            f"({cfg.max_num_batched_tokens} batched tokens)",
        ),  # fmt: skip
    ]
    if p.device_type == "cuda":
        rows += [
            ("activation reserve", f"{_size(p.activation_reserve_bytes)} kept free by the engine"),
            ("CUDA context", _size(p.cuda_context_bytes)),
            ("CUDA graphs", "none captured (the engine runs eagerly)"),
            (
                "engine's share",
                f"{_size(p.memory_bytes - p.outside_share_bytes)} (--gpu-memory-utilization "
                f"{cfg.gpu_memory_utilization:g} of the device, weights included)",
            ),
            ("in use by others", _size(p.used_bytes)),
            (
                "outside the share",
                f"{_size(p.outside_share_bytes)} (1 - --gpu-memory-utilization: other "
                "processes, other engines)",
            ),
        ]
    if p.swap_bytes:
        rows.append(("swap space", f"{_size(p.swap_bytes)} of host memory"))
    verdict = "fits" if p.fits else "does NOT fit"
    rows.append(("total", f"{_size(p.total_bytes)} of {_size(p.memory_bytes)}: {verdict}"))
    return rows


def _as_json(p: MemoryPlan, flags: list[str], notes: list[str]) -> dict[str, Any]:
    data = {k: v for k, v in asdict(p).items() if k not in ("engine_config", "model_config")}
    data["weights"]["total"] = p.weights.total
    data.update(
        kv_bytes_per_token=p.kv_bytes_per_token,
        kv_bytes_per_seq=p.kv_bytes_per_seq,
        blocks_per_seq=p.blocks_per_seq,
        full_length_seqs=p.full_length_seqs,
        total_bytes=p.total_bytes,
        fits=p.fits,
        flags=flags,
        notes=notes,
    )
    return data


def run(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig, parse_memory
    from engine.memory_plan import plan
    from portico.registry import ModelNotFound

    try:
        config = EngineConfig.from_cli_args(args)
        memory = parse_memory(args.memory, "--memory") if args.memory is not None else None
        used = None
        if args.memory_used is not None:
            used = 0 if args.memory_used == "0" else parse_memory(args.memory_used, "--memory-used")
        p = plan(config, memory, used)
    except (ValueError, ModelNotFound) as exc:
        print(f"portico plan: {exc}", file=sys.stderr)
        return 2
    flags, notes = recommend(p)
    if args.json:
        print(json.dumps(_as_json(p, flags, notes), indent=2))
        return 0 if flags else 1
    width = max(len(name) for name, _ in _rows(p))
    for name, value in _rows(p):
        print(f"{name:<{width}}  {value}")
    for note in notes:
        print(f"note: {note}")
    if flags:
        print("\nportico engine --model " + " ".join([config.model, *flags]))
    return 0 if flags else 1
