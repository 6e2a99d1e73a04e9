"""Step times of the batch invariant default against the code path it replaced, in one process:
``python -m load.invariant_step_ab [--rounds N]``.

The default model is loaded once in float32 on its GGUF blocks; each case (a one-row decode, 64
decodes, a 512-token prefill, each with the LM head on its sampled rows) is timed alternately
with the panels detached and PyTorch's silu (the float32 path before issue 42: the block kernel
up to a few rows, MKL's matmul beyond) and attached with the native silu (the default now); best
of the rounds, 2 threads. Interleaving keeps a loaded machine's drift out of the ratio
(docs/benchmarks.md, "Batch invariant numerics").
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine import kernels
from engine.attention import AttentionMetadata
from engine.kv_cache_dtype import cache_shape
from engine.model_loader import load_model
from engine.models.block_linear import GGUFBlocks
from portico.registry import resolve

BLOCK = 16
CONTEXT = 300  # positions a decode row attends to


def _torch_silu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    loaded = load_model(resolve("smollm2-135m"), torch.float32, "cpu", "gguf")
    model, cfg = loaded.model, loaded.config
    blocks: list[GGUFBlocks] = [b for b in (getattr(mod, "blocks", None) for mod in model.modules())
                                if b is not None]  # fmt: skip
    if model.lm_head_blocks is not None:
        blocks.append(model.lm_head_blocks)
    panels = [b.panels for b in blocks]
    native_silu = kernels.silu_mul

    def use(new: bool) -> None:
        for b, p in zip(blocks, panels, strict=True):
            b.panels = p if new else None
        kernels.silu_mul = native_silu if new else _torch_silu  # type: ignore[assignment]

    per_seq = (CONTEXT + 64) // BLOCK + 1
    shape = cache_shape(torch.float32, 64 * per_seq + 8, BLOCK, cfg.num_key_value_heads,
                        cfg.head_dim)  # fmt: skip
    caches = [torch.randn(shape) * 0.5 for _ in range(cfg.num_hidden_layers)]

    def decode(rows: int) -> Callable[[], object]:
        tables = [list(range(r * per_seq, (r + 1) * per_seq)) for r in range(rows)]
        meta = AttentionMetadata.build([1] * rows, [CONTEXT] * rows, tables, BLOCK)
        ids, pos = torch.randint(100, 40000, (rows,)), torch.full((rows,), CONTEXT - 1)
        return lambda: model.forward_and_logits(ids, pos, caches, meta, torch.arange(rows))

    def prefill(tokens: int) -> Callable[[], object]:
        table = [list(range(tokens // BLOCK + 1))]
        meta = AttentionMetadata.build([tokens], [tokens], table, BLOCK)
        ids, pos = torch.randint(100, 40000, (tokens,)), torch.arange(tokens)
        return lambda: model.forward_and_logits(ids, pos, caches, meta, torch.tensor([tokens - 1]))

    cases = {"decode 1 row": (decode(1), 20), "decode 64 rows": (decode(64), 4),
             "prefill 512": (prefill(512), 2)}  # fmt: skip
    best = {(name, new): float("inf") for name in cases for new in (False, True)}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, (step, reps) in cases.items():
                for new in (False, True):
                    use(new)
                    step()  # warm
                    for _ in range(reps):
                        start = time.perf_counter()
                        step()
                        best[name, new] = min(best[name, new], time.perf_counter() - start)
    use(True)
    for name in cases:
        today, new_ms = best[name, False] * 1e3, best[name, True] * 1e3
        print(f"{name}: today {today:.1f} ms, batch invariant {new_ms:.1f} ms, "
              f"speed new/today {today / new_ms:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
