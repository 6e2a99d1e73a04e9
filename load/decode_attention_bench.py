"""Decode attention's read bandwidth on a CUDA GPU, beside the card's measured copy bandwidth.

``python -m load.decode_attention_bench [--output PATH]`` times the split-K decode kernel
(engine/kernels/triton_decode_attention.py) and the general paged kernel it replaced for
decodes, at issue 41's shapes (256 sequences x 1,024 tokens and 64 x 2,048; 8B-class heads:
32 query heads, 8 KV heads, head_dim 128; blocks of 16), for each KV cache dtype. A kernel's
bandwidth is the K and V bytes it must read (every row once, int8 scales included) over its
median time; the copy bandwidth is ``2 * bytes / time`` of one large device-to-device copy.
Timing uses CUDA events after a warm-up; nothing here runs on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kv_cache_dtype import bytes_per_token_head, cache_shape, storage_dtype

SHAPES = ((256, 1024), (64, 2048))  # (sequences, tokens each)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
KV_DTYPES = ("auto", "int8", "fp8_e4m3")


def kv_bytes(num_seqs: int, context: int, cache_dtype: torch.dtype) -> int:
    """Bytes of K and V a decode step must read: every context row of every KV head once."""
    return 2 * num_seqs * context * KV_HEADS * bytes_per_token_head(cache_dtype, HEAD_DIM)


def _median_ms(fn: Callable[[], object], iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes per second of one device-to-device copy of ``gib`` GiB (read + write)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / (ms / 1e3)


def _case(num_seqs: int, context: int, kv: str) -> dict[str, float | int | str]:
    from engine.attention import AttentionMetadata
    from engine.kernels.triton_decode_attention import decode_attention_triton
    from engine.kernels.triton_paged_attention import paged_attention_triton

    cache_dtype = storage_dtype(kv, torch.bfloat16)
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    shape = cache_shape(cache_dtype, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = torch.randint(-100, 100, shape, dtype=torch.int8, device="cuda")
    if cache_dtype != torch.int8:  # random finite values of the cache's type
        cache = torch.randn(shape, device="cuda").to(cache_dtype)
    order = torch.randperm(num_blocks).view(num_seqs, blocks_per_seq).tolist()
    meta = AttentionMetadata.build([1] * num_seqs, [context] * num_seqs, order, BLOCK_SIZE, "cuda")
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    scale = HEAD_DIM**-0.5
    split_ms = _median_ms(
        lambda: decode_attention_triton(q, cache, meta.block_tables, meta.seq_lens, scale)
    )
    general_ms = _median_ms(
        lambda: paged_attention_triton(
            q,
            cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            meta.query_lens_cpu,
            meta.seq_lens_cpu,
        )  # fmt: skip
    )
    read = kv_bytes(num_seqs, context, cache_dtype)
    return {
        "num_seqs": num_seqs, "context": context, "kv_cache_dtype": kv, "kv_bytes": read,
        "split_k_ms": split_ms, "split_k_gbps": read / split_ms / 1e6,
        "general_ms": general_ms, "general_gbps": read / general_ms / 1e6,
        "split_k_us_per_token": split_ms * 1e3 / num_seqs,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=".portico/bench/decode_attention.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention_bench needs a CUDA GPU")
    copy = copy_bandwidth()
    rows = [_case(n, c, kv) for n, c in SHAPES for kv in KV_DTYPES]
    for row in rows:
        row["split_k_share_of_copy"] = float(row["split_k_gbps"]) * 1e9 / copy
        print(json.dumps(row), flush=True)
    report = {"device": torch.cuda.get_device_name(), "copy_gbps": copy / 1e9, "cases": rows}
    print(json.dumps({"device": report["device"], "copy_gbps": report["copy_gbps"]}))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
