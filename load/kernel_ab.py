"""Native kernels against other builds of them, in one process: ``python -m load.kernel_ab``.

On a shared 2-core VM, decode speed drifts by 20-40% between processes and minutes (memory
bandwidth comes and goes with the neighbours), which hides the 3-10% a kernel change makes. This
bench loads the model once and builds the native library from several sources (a git revision,
the working tree, the same sources with other ``-D`` settings); then it alternates between them
round after round, timing each step, so every variant sees the same drift. It reports each
variant's step-time percentiles.

    python -m load.kernel_ab --variant base=rev:HEAD~3 --variant now=tree
    python -m load.kernel_ab --variant a8=tree:-DQ8_AHEAD=8 --variant a16=tree:-DQ8_AHEAD=16
    python -m load.kernel_ab --batch 64 --context 450 --variant base=rev:HEAD~1 --variant now=tree
    python -m load.kernel_ab --dtype float32 --context 2000 --variant base=rev:HEAD --variant n=tree

``--dtype bfloat16`` (the default) times the bf16 + int8 step, ``--dtype float32`` the default
numerics' batch invariant one; ``--kv-cache-dtype float16`` gives it the default path's float16
cache (the cache is otherwise of the step's dtype).

A variant is ``NAME=tree[:DEFINES]`` or ``NAME=rev:REV[:DEFINES]``. The model's weights are
packed once, by the working tree's library: compare revisions whose packed formats agree
(batches above 8 rows do not use the packed blocks, so any revision serves for those).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.kernels import cpu
from engine.model_loader import load_model
from portico.registry import resolve


@dataclass
class Variant:
    name: str
    lib: Any
    times_ms: list[float]


def build_variant(spec: str, workdir: Path) -> tuple[str, Path]:
    """Compile the library for ``NAME=tree[:DEFINES]`` / ``NAME=rev:REV[:DEFINES]``."""
    name, _, where = spec.partition("=")
    if where.startswith("rev:"):
        rev, _, defines = where[4:].partition(":")
        src = workdir / f"src-{name}"
        src.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "archive", rev, str(cpu.SOURCE_DIR.relative_to(Path.cwd()))],
            capture_output=True, check=True,
        ).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        source_dir = src / cpu.SOURCE_DIR.relative_to(Path.cwd())
    elif where.startswith("tree"):
        defines = where[5:] if where.startswith("tree:") else ""
        source_dir = cpu.SOURCE_DIR
    else:
        raise SystemExit(f"bad variant {spec!r}: NAME=tree[:DEFINES] or NAME=rev:REV[:DEFINES]")
    out = workdir / f"{name}.so"
    cpu.compile_library(cpu._compiler() or "cc", out, source_dir, defines.split())
    return name, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--variant", action="append", required=True, help="NAME=tree|rev:REV[:DEFINES]"
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1, help="decode rows per step")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16",
        help="bfloat16: the bf16 + int8 step (decode_step.c); float32: the default numerics' "
        "batch invariant step (panel_step.c)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", choices=("step", "float16"), default="step",
        help="the cache's dtype: the step's (as before), or float16 (the default CPU path's)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    args = parser.parse_args(argv)
    if args.kv_cache_dtype == "float16" and args.dtype != "float32":
        parser.error("--kv-cache-dtype float16 goes with --dtype float32 (the default CPU path)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        variants = []
        for spec in args.variant:
            name, path = build_variant(spec, Path(tmp))
            variants.append(Variant(name, cpu.open_library(path), []))
        cpu_device = torch.device("cpu")
        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        if args.dtype == "float32":
            loaded = load_model(resolve(args.model), dtype, cpu_device, "gguf")
        else:
            loaded = load_model(resolve(args.model), dtype, cpu_device, "auto", "int8")
        cfg, model = loaded.config, loaded.model
        cache_dtype = torch.float16 if args.kv_cache_dtype == "float16" else dtype
        block = 16
        per_seq = (args.context + block) // block + 1
        caches = [
            torch.randn(2, args.batch * per_seq + 1, block, cfg.num_key_value_heads, cfg.head_dim)
            .to(cache_dtype)
            for _ in range(cfg.num_hidden_layers)
        ]  # fmt: skip
        tables = [[1 + i * per_seq + b for b in range(per_seq)] for i in range(args.batch)]
        meta = AttentionMetadata.build([1] * args.batch, [args.context] * args.batch, tables, block)
        ids = torch.randint(0, cfg.vocab_size, (args.batch,))
        pos = torch.full((args.batch,), args.context - 1)
        rows = torch.arange(args.batch)
        real_load = cpu.load
        try:
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for v in variants:
                        cpu.load = lambda lib=v.lib: lib  # type: ignore[assignment]
                        model.forward_and_logits(ids, pos, caches, meta, rows)  # warm
                        for _ in range(args.steps):
                            start = time.perf_counter()
                            model.forward_and_logits(ids, pos, caches, meta, rows)
                            v.times_ms.append((time.perf_counter() - start) * 1e3)
        finally:
            cpu.load = real_load  # type: ignore[assignment]
    print(
        f"{args.model} {'float32 panels' if args.dtype == 'float32' else 'bf16 int8'} "
        f"batch={args.batch} context={args.context} kv={str(cache_dtype).removeprefix('torch.')} "
        f"threads={args.threads} rounds={args.rounds}x{args.steps} steps (forward + head, ms/step)"
    )
    for v in variants:
        t = sorted(v.times_ms)
        pick = {q: t[int(q / 100 * (len(t) - 1))] for q in (10, 25, 50, 75)}
        print(f"  {v.name:12s} " + "  ".join(f"p{q} {ms:.2f}" for q, ms in pick.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
