"""The pure parts of ``portico bench gpu`` (load/gpu_bench.py), testable on a CPU.

Model shapes the benchmark runs (the default model's, a 1B-class and an 8B-class Llama),
folders that give a shape to ``--load-format dummy`` (config.json and a tokenizer, no
weights), the byte accounting of a decode step, and the report.

Units: bytes, seconds (``*_ms``: milliseconds), GB = 1e9 bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    """A Llama's shape: what config.json says, and what the byte accounting needs."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def hf_config(self) -> dict[str, Any]:
        """A Hugging Face Llama config.json for this shape."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        }

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o, gate, up, down and its two norms."""
        h, d = self.hidden_size, self.head_dim
        attention = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        attention += self.num_attention_heads * d * h
        return attention + 3 * h * self.intermediate_size + 2 * h

    @property
    def num_params(self) -> int:
        """Every parameter: embedding, layers, final norm, and the head unless tied."""
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embedding
        return embedding + self.num_hidden_layers * self.layer_params + self.hidden_size + head


SHAPES: dict[str, Shape] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json (the default model)
    "smollm2-135m": Shape("smollm2-135m", 576, 1536, 30, 9, 3, 49152, True, 8192, 100000.0),
    # a 1B-class Llama (Llama-3.2-1B's widths and vocabulary)
    "llama-1b": Shape("llama-1b", 2048, 8192, 16, 32, 8, 128256, True, 8192, 500000.0),
    # an 8B-class Llama (Llama-3.1-8B's widths): the kernels' shapes only
    "llama-8b": Shape("llama-8b", 4096, 14336, 32, 32, 8, 128256, False, 8192, 500000.0),
}


def write_shape_folder(folder: Path, shape: Shape) -> Path:
    """A model folder ``--load-format dummy`` serves: ``shape``'s config.json and a word-level
    tokenizer with one word per token id (``t0`` ... ``t{vocab-1}``), so every id the random
    model samples decodes to text and a stream's chunks can be timed. No hub, no weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))
    vocab = {f"t{i}": i for i in range(shape.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0"
    )
    fast.save_pretrained(str(folder))
    return folder


# --------------------------------------------------------------------------- byte accounting


def kv_bytes_per_token_layer(shape: Shape, kv_value_bytes: float) -> float:
    """K and V of one token in one layer (``kv_value_bytes``: 2 for bf16; int8 rows: 1 + 4
    scale bytes per head_dim values)."""
    return 2 * shape.num_key_value_heads * shape.head_dim * kv_value_bytes


def decode_attention_bytes(shape: Shape, batch: int, context: int, kv_value_bytes: float) -> int:
    """What one layer's decode attention must read at least: every sequence's K and V over
    its context (queries and outputs, ``batch`` rows, are counted too)."""
    kv = batch * context * kv_bytes_per_token_layer(shape, kv_value_bytes)
    rows = 2 * batch * shape.num_attention_heads * shape.head_dim * kv_value_bytes
    return int(kv + rows)


def decode_step_bytes(
    shape: Shape, batch: int, context: int, weight_bytes: float, kv_value_bytes: float
) -> dict[str, int]:
    """The least memory traffic of one decode step of ``batch`` sequences at ``context``
    tokens: every layer's weights and the head read once (the embedding only gathers
    ``batch`` rows), every layer's attention reads (:func:`decode_attention_bytes`), and the
    new K/V rows written."""
    h = shape.hidden_size
    weights = shape.num_hidden_layers * shape.layer_params + h + shape.vocab_size * h
    attention = shape.num_hidden_layers * decode_attention_bytes(
        shape, batch, context, kv_value_bytes
    )
    kv_write = shape.num_hidden_layers * batch * kv_bytes_per_token_layer(shape, kv_value_bytes)
    out = {
        "weights": int(weights * weight_bytes),
        "attention": attention,
        "kv_write": int(kv_write),
    }
    out["total"] = sum(out.values())
    return out


def ideal_ms(num_bytes: float, bandwidth_gbs: float) -> float:
    """Milliseconds to move ``num_bytes`` at ``bandwidth_gbs`` GB/s (the floor of a step that
    only streams memory)."""
    return num_bytes / (bandwidth_gbs * 1e9) * 1e3


def bandwidth_row(
    shape: Shape,
    batch: int,
    context: int,
    attention_s: float,
    copy_gbs: float,
    step_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """One line of section (e): the measured attention kernel's GB/s against the card's copy
    bandwidth, and the step's least bytes as a time floor (bf16 weights and cache)."""
    attn = decode_attention_bytes(shape, batch, context, 2)
    step = decode_step_bytes(shape, batch, context, 2, 2)
    gbs = attn / attention_s / 1e9
    row: dict[str, Any] = {
        "shape": shape.name,
        "batch": batch,
        "context": context,
        "attention_bytes_per_layer": attn,
        "attention_ms_per_layer": round(attention_s * 1e3, 4),
        "attention_gbs": round(gbs, 1),
        "attention_share_of_copy": round(gbs / copy_gbs, 3),
        "step_bytes": step,
        "step_floor_ms": round(ideal_ms(step["total"], copy_gbs), 3),
    }
    if step_tpot_ms is not None:
        row["served_tpot_ms"] = round(step_tpot_ms, 3)
        row["tpot_over_floor"] = round(step_tpot_ms / row["step_floor_ms"], 2)
    return row


# --------------------------------------------------------------------------- the report

SECTIONS = ("kernels", "greedy", "offline", "served", "bandwidth", "fp8", "async", "invariant")


def kernel_verdict(dtype: str, attn_diff: float, cache_equal: bool) -> bool:
    """A kernel case passes: the cache written byte for byte as the reference writes it, the
    attention within float32's (1e-4 over thousands of positions) or bf16's (one rounding
    step at |x| ~ 4: 3e-2) reach."""
    limit = 1e-4 if dtype == "float32" else 3e-2
    return cache_equal and math.isfinite(attn_diff) and attn_diff <= limit


def build_report(
    card: dict[str, Any], sections: dict[str, Any], elapsed_s: float, command: str
) -> dict[str, Any]:
    """The JSON report: the card, each section's results (a section not run says why), and
    the verdicts the docs quote."""
    missing = {name: {"skipped": "not run"} for name in SECTIONS if name not in sections}
    merged = {**missing, **sections}
    kernels = merged["kernels"].get("cases", [])
    greedy = merged["greedy"]
    verdicts = {
        "kernels_match": bool(kernels) and all(c["ok"] for c in kernels),
        "greedy_equal": bool(greedy.get("prompts"))
        and greedy.get("equal") == greedy["prompts"]
        and greedy.get("equal_prefix_caching_off", greedy["prompts"]) == greedy["prompts"],
    }
    return {
        "command": command,
        "card": card,
        "elapsed_s": round(elapsed_s, 1),
        "verdicts": verdicts,
        "sections": {name: merged[name] for name in SECTIONS},
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A short human summary of the report."""
    s = report["sections"]
    lines = [f"card: {report['card'].get('name', '?')}  ({report['elapsed_s']} s)"]
    kernels = s["kernels"].get("cases", [])
    if kernels:
        passed = sum(c["ok"] for c in kernels)
        lines.append(f"(a) kernels vs references: {passed}/{len(kernels)} cases match")
    if "prompts" in s["greedy"]:
        g = s["greedy"]
        off = g.get("equal_prefix_caching_off", "?")
        lines.append(
            f"(b) greedy vs transformers ({g['model']}): {g['equal']}/{g['prompts']} "
            f"(prefix caching off: {off}/{g['prompts']})"
        )
    for name, run in s["offline"].get("runs", {}).items():
        if "error" in run:
            lines.append(f"(c) offline {name}: {run['error']}")
        elif "decode_tokens_per_s" in run:
            lines.append(f"(c) offline {name}: {run['decode_tokens_per_s']} tok/s decode")
        else:
            lines.append(f"(c) offline {name}: {run['output_tokens_per_s']} output tok/s")
    for level, run in sorted(s["served"].get("levels", {}).items(), key=lambda kv: int(kv[0])):
        if "output_throughput" not in run:
            lines.append(f"(d) served c={level}: {run.get('skipped', 'not run')}")
            continue
        lines.append(
            f"(d) served c={level}: {run['output_throughput']:.1f} tok/s, TTFT p50 "
            f"{run['ttft_ms']['median']:.1f} ms, TPOT p50 {run['tpot_ms']['median']:.2f} ms"
        )
    band = s["bandwidth"]
    if "copy_gbs" in band:
        lines.append(f"(e) copy bandwidth {band['copy_gbs']} GB/s")
        for row in band["rows"]:
            lines.append(
                f"    {row['shape']} b={row['batch']} ctx={row['context']}: attention "
                f"{row['attention_gbs']} GB/s ({row['attention_share_of_copy']:.0%} of copy), "
                f"step floor {row['step_floor_ms']} ms"
            )
    for name, run in s["fp8"].get("runs", {}).items():
        stream = run["single_stream"]["decode_tokens_per_s"]
        batch = next(v for k, v in run.items() if k.startswith("c"))["output_tokens_per_s"]
        lines.append(f"(f) {s['fp8']['shape']} {name}: one stream {stream} tok/s, "
                     f"c={s['fp8']['requests']} {batch} output tok/s")  # fmt: skip
    for name, run in s["async"].get("runs", {}).items():
        stream = run["single_stream"]["decode_tokens_per_s"]
        batch = next(v for k, v in run.items() if k.startswith("c"))["output_tokens_per_s"]
        lines.append(f"(g) {s['async']['shape']} {name}: one stream {stream} tok/s, "
                     f"c={s['async']['requests']} {batch} output tok/s")  # fmt: skip
    inv = s["invariant"]
    for name, run in inv.get("runs", {}).items():
        stream = run["single_stream"]["decode_tokens_per_s"]
        batch = next(v for k, v in run.items() if k.startswith("c"))["output_tokens_per_s"]
        same = inv["same_tokens_alone_and_batched"][name]
        lines.append(f"(h) {inv['shape']} {name}: one stream {stream} tok/s, "
                     f"c={inv['requests']} {batch} output tok/s, same tokens alone and "
                     f"batched: {same}")  # fmt: skip
    for name in SECTIONS:
        if "skipped" in s[name] or "error" in s[name]:
            lines.append(f"({name}) {s[name].get('skipped') or s[name].get('error')}")
    return lines


def shape_table() -> list[dict[str, Any]]:
    """The shapes with their parameter counts, for the report and the docs."""
    return [asdict(shape) | {"num_params": shape.num_params} for shape in SHAPES.values()]
