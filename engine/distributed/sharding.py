"""Cut a loaded Llama down to one rank's shard (Megatron/vLLM's split, one all-reduce per
half-block).

Column-parallel (output rows split, no communication): ``qkv_proj`` keeps this rank's query
heads, key heads and value heads (three row ranges of the fused weight), ``gate_up_proj`` its
slice of gate and its slice of up. Row-parallel (input columns split, outputs summed over the
ranks): ``o_proj`` and ``down_proj`` become :class:`RowParallelLinear`, whose partial output is
all-reduced, then the bias (if any) is added once. So each decoder layer does two all-reduces,
one after attention and one after the MLP; attention itself is local, over this rank's heads
and this rank's KV cache (which holds only this rank's KV heads).

Replicated on every rank: the embedding, the norms, the RoPE tables and the output projection
(only rank 0 computes logits). GGUF blocks (:class:`~engine.models.block_linear.GGUFBlocks`)
are cut the same way: by output rows for column-parallel, by input blocks of 32 for
row-parallel, so each rank's block kernel reads only its share of the quantized weights.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import cast

import torch
from torch import nn

from engine.distributed.group import TensorParallelGroup
from engine.model_config import ModelConfig
from engine.models.block_linear import BlockLinear, GGUFBlocks
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)

BLOCK = 32  # weights per GGUF block along the input dimension


def check_divisible(cfg: ModelConfig, world_size: int) -> None:
    """ValueError naming the flag unless heads, KV heads and the MLP split evenly."""
    for what, count in (
        ("attention heads", cfg.num_attention_heads),
        ("KV heads", cfg.num_key_value_heads),
        ("MLP intermediate size", cfg.intermediate_size),
    ):
        if count % world_size:
            raise ValueError(
                f"--tensor-parallel-size {world_size} must divide the model's {what} ({count}); "
                "replicating KV heads over ranks is not supported"
            )


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes one rank holds: its heads, its KV heads, its slice of the MLP."""
    check_divisible(cfg, world_size)
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // world_size,
        num_key_value_heads=cfg.num_key_value_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
    )


class RowParallelLinear(BlockLinear):
    """A linear whose input columns are split over the ranks: the local product is a partial
    sum, all-reduced to the full output; the bias is added once, after the reduction."""

    def __init__(self, source: BlockLinear, columns: slice, group: TensorParallelGroup) -> None:
        width = columns.stop - columns.start
        super().__init__(width, source.out_features, bias=False, device="meta")
        self.weight = nn.Parameter(source.weight[:, columns].contiguous(), requires_grad=False)
        self.reduced_bias = source.bias
        self.group = group
        self.blocks = _input_blocks(source.blocks, columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(super().forward(x))
        return out if self.reduced_bias is None else out.add_(self.reduced_bias)


def _input_blocks(blocks: GGUFBlocks | None, columns: slice) -> GGUFBlocks | None:
    """The blocks of input ``columns``, or None where the cut is not on a 32-weight block edge
    (that shard then runs its dense weight)."""
    if blocks is None:
        return None
    if columns.start % BLOCK or columns.stop % BLOCK:
        log.info("GGUF blocks dropped for a shard of columns %s (not whole blocks)", columns)
        return None
    first, last = columns.start // BLOCK, columns.stop // BLOCK
    per_block = blocks.qs.shape[1] // blocks.scales.shape[1]  # 16 bytes (q4_1) or 32 (q8_0)
    mins = blocks.mins[:, first:last].contiguous() if blocks.mins is not None else None
    shard = GGUFBlocks(
        blocks.kind,
        blocks.qs[:, first * per_block : last * per_block].contiguous(),
        blocks.scales[:, first:last].contiguous(),
        mins,
    )
    if blocks.packed_q8 is not None:
        shard.pack_q8()
    if blocks.panels is not None:
        shard.pack_panels()
    return shard


def _keep_rows(linear: BlockLinear, rows: torch.Tensor) -> None:
    """Column-parallel in place: keep output ``rows`` of the weight, bias and blocks."""
    linear.weight = nn.Parameter(linear.weight[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].contiguous(), requires_grad=False)
    if linear.blocks is not None:
        int8 = linear.blocks.packed_q8 is not None
        panels = linear.blocks.panels is not None
        linear.blocks = linear.blocks.rows(rows)
        if int8:
            linear.blocks.pack_q8()
        if panels:
            linear.blocks.pack_panels()
    linear.out_features = int(rows.numel())


def _span(start: int, size: int) -> torch.Tensor:
    return torch.arange(start, start + size)


def shard_model(model: LlamaForCausalLM, group: TensorParallelGroup) -> ModelConfig:
    """Cut ``model`` (whole, on the CPU) to ``group.rank``'s shard in place; returns the
    shard's :class:`ModelConfig` (what this rank's KV cache is sized from)."""
    cfg = model.config
    rank, world = group.rank, group.world_size
    local = shard_config(cfg, world)
    d = cfg.head_dim
    q_size, kv_size = local.num_attention_heads * d, local.num_key_value_heads * d
    inter = local.intermediate_size
    qkv_rows = torch.cat(
        [
            _span(rank * q_size, q_size),
            _span(cfg.num_attention_heads * d + rank * kv_size, kv_size),
            _span(
                (cfg.num_attention_heads + cfg.num_key_value_heads) * d + rank * kv_size, kv_size
            ),
        ]
    )
    gate_up_rows = torch.cat(
        [_span(rank * inter, inter), _span(cfg.intermediate_size + rank * inter, inter)]
    )
    for layer in cast("list[LlamaDecoderLayer]", list(model.model.layers)):
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn.qkv_proj, qkv_rows)
        attn.o_proj = RowParallelLinear(
            attn.o_proj, slice(rank * q_size, (rank + 1) * q_size), group
        )
        attn.num_heads, attn.num_kv_heads = local.num_attention_heads, local.num_key_value_heads
        _keep_rows(mlp.gate_up_proj, gate_up_rows)
        mlp.down_proj = RowParallelLinear(
            mlp.down_proj, slice(rank * inter, (rank + 1) * inter), group
        )
        mlp.intermediate_size = inter
    for module in model.modules():  # packed copies of the whole weights are stale now
        if isinstance(module, BlockLinear):
            module.packed = None
    # The fused native step has no all-reduce: a rank runs its layers from Python. Shards cut
    # from int8-packed blocks are packed again for the int8 kernels.
    model.fused_step = None
    model.config = local
    return local
