"""Forward-only decode speed of the model runner: ``python -m load.forward_bench``.

Measures tokens per second of pure decode steps (every request has one new token and a
context of ``context_len`` tokens in the paged cache) at the given batch sizes, through
:class:`~engine.attention.AttentionMetadata` and the model, without scheduler or sampler.
Reusable from benchmarks: :func:`measure_decode`.

On a CPU shared with other busy processes, run with ``OMP_WAIT_POLICY=PASSIVE`` (or
``--threads 1``): OpenMP's default spin-waiting made each op up to 15x slower here when the
second core was taken, while passive waiting costs little when it is free.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.attention import AttentionMetadata
from engine.config import GGUF_ACTIVATIONS
from engine.kernels.reference import to_cache_rows
from engine.kv_cache_dtype import KV_CACHE_DTYPES, storage_dtype
from engine.model_loader import (
    QUANTIZATIONS,
    LoadedModel,
    choose_device,
    choose_dtype,
    load_model,
)
from portico.registry import resolve


def measure_decode(
    loaded: LoadedModel,
    batch_size: int,
    context_len: int = 128,
    steps: int = 8,
    block_size: int = 16,
    clock: str = "wall",
    kv_cache_dtype: str = "auto",
) -> float:
    """Decode tokens per second (forward + logits of every row) at ``batch_size``.

    ``clock`` "cpu": this thread's CPU time instead of wall time (with one torch thread, the
    process's whole compute; robust to other work on a shared machine, which only stretches
    wall time)."""
    now = time.thread_time if clock == "cpu" else time.perf_counter
    cfg = loaded.config
    blocks_per_seq = -(-(context_len + steps + 1) // block_size)
    num_blocks = batch_size * blocks_per_seq + 1
    shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    cache_dtype = storage_dtype(kv_cache_dtype, loaded.dtype)
    caches = [
        to_cache_rows(torch.randn(shape, device=loaded.device), cache_dtype)
        for _ in range(cfg.num_hidden_layers)
    ]
    # Interleave the requests' blocks so tables are not contiguous, as in a busy engine.
    tables = [[1 + i + b * batch_size for b in range(blocks_per_seq)] for i in range(batch_size)]
    ids = torch.randint(0, cfg.vocab_size, (batch_size,), device=loaded.device)

    def step(seq_len: int) -> None:
        meta = AttentionMetadata.build(
            [1] * batch_size, [seq_len] * batch_size, tables, block_size, loaded.device
        )
        pos = torch.full((batch_size,), seq_len - 1, device=loaded.device)
        hidden = loaded.model(ids, pos, caches, meta)
        loaded.model.compute_logits(hidden)

    with torch.inference_mode():
        step(context_len)  # warm-up
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        start = now()
        for i in range(steps):
            step(context_len + 1 + i)
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = now() - start
    return batch_size * steps / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: keep a GGUF model's blocks for small batches on CPU",
    )
    parser.add_argument(
        "--gguf-activations",
        default="int8",
        choices=GGUF_ACTIVATIONS,
        help="int8: llama.cpp-style int8 inputs to the block linears, fused small steps",
    )
    parser.add_argument(
        "--no-fused",
        action="store_true",
        help="run small steps layer by layer from Python even where the fused step serves",
    )
    parser.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="cpu: this thread's CPU time (needs --threads 1): robust on a shared machine",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--repeats", type=int, default=1, help="report the best of N runs")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: pass --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = choose_device(args.device)
    loaded = load_model(
        resolve(args.model),
        choose_dtype(args.dtype, device),
        device,
        args.quantization,
        args.gguf_activations,
    )
    if args.no_fused:
        loaded.model.fused_step = None
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        tps = max(
            measure_decode(
                loaded,
                batch,
                args.context_len,
                args.steps,
                clock=args.clock,
                kv_cache_dtype=args.kv_cache_dtype,
            )  # fmt: skip
            for _ in range(max(1, args.repeats))
        )
        print(
            f"{loaded.name} {loaded.dtype} {device} quantization={args.quantization} "
            f"gguf-activations={args.gguf_activations} "
            f"fused={loaded.model.fused_step is not None} clock={args.clock} "
            f"threads={torch.get_num_threads()} kv-cache-dtype={args.kv_cache_dtype} "
            f"batch={batch} context={args.context_len}: {tps:.1f} tok/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
