"""The batch invariant float32 path's small steps in one native call (``csrc/panel_step.c``).

``--dtype auto`` on a GGUF model runs every linear on the panel kernel (``csrc/panel_linear.c``)
so a row's bits never depend on its step (docs/numerics.md). Run op by op from Python, one
stream decoding paid the interpreter, a tensor allocation and an OpenMP wake-up for each of
~10 kernels per layer. :class:`FusedPanelStep` hands the native library one table of every
layer's panels once; each step of at most :data:`MAX_ROWS` tokens then runs embedding-to-final
norm, and the LM head on the rows to sample, in one call that keeps its threads in one
parallel region.

It computes the same bits as the Python path, op for op: every stage calls the C function the
Python path calls (RMSNorm and the residual adds: ``add_rms_norm``, which the float32 Python
path also runs once :func:`use_native_norms` has switched it; RoPE and the cache write; paged
attention's work items; ``silu_mul``; the panel linears' tiles), on the same float32 rows.
``tests/engine/test_panel_step.py`` checks the logits with ``torch.equal``.

It serves a model only where that call computes the same layers: float32 weights on the CPU,
every projection and the head in GGUF panels, sizes the kernels take (attention's head limits,
widths a multiple of 32). LoRA steps with adapter rows take the Python path (no adapter deltas
here), as does every rank of a tensor-parallel engine (no all-reduce inside; the sharding
clears ``fused_step``), a vision model's steps that carry image rows (``inputs_embeds``), and
a KV cache that is neither float32 nor int8 (fp8_e4m3, bfloat16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from engine.kernels import cpu
from engine.models.block_linear import BlockLinear, GGUFBlocks
from engine.models.fused_step import MAX_ROWS, NativeStep, run_native_step

if TYPE_CHECKING:
    from engine.attention import AttentionMetadata
    from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_KIND_CODES = {"q4_1": 0, "q8_0": 1}


def use_native_norms(model: torch.nn.Module) -> None:
    """Make every RMSNorm of ``model`` run float32 through the native ``add_rms_norm``
    (csrc/norm_rope.c), the kernel the fused step calls, so the Python path's bits equal it."""
    from engine.models.llama import RMSNorm

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.native_float32 = True


def _panel_fields(
    blocks: GGUFBlocks | None, last: int, keep: list[torch.Tensor]
) -> list[int] | None:
    """The three table fields of ``blocks``' panels (the third ``last``), or None."""
    if blocks is None or blocks.panels is None or blocks.kind not in _KIND_CODES:
        return None
    keep.append(blocks.panels)
    return [_KIND_CODES[blocks.kind], blocks.panels.data_ptr(), last]


def _linear_fields(linear: BlockLinear, keep: list[torch.Tensor]) -> list[int] | None:
    if linear.fp8 is not None:
        return None
    bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None
    if bias is not None:
        keep.append(bias)
    return _panel_fields(linear.blocks, bias.data_ptr() if bias is not None else 0, keep)


def _layer_row(layer: LlamaDecoderLayer, keep: list[torch.Tensor]) -> list[int] | None:
    attn, mlp = layer.self_attn, layer.mlp
    fields = [_linear_fields(lin, keep) for lin in (attn.qkv_proj, attn.o_proj,
                                                   mlp.gate_up_proj, mlp.down_proj)]  # fmt: skip
    norms = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
    if any(f is None for f in fields) or any(
        n.dtype != torch.float32 or not n.is_contiguous() for n in norms
    ):
        return None
    keep.extend(norms)
    row = [norms[0].data_ptr(), norms[1].data_ptr()]
    for f in fields:
        row.extend(f or [])
    return row


class FusedPanelStep(NativeStep):
    """A float32 panel model's layer table for the native fused step, built once
    (:meth:`build`); the same interface as :class:`engine.models.fused_step.FusedDecodeStep`."""

    def __init__(
        self, model: LlamaForCausalLM, table: torch.Tensor, keep: list[torch.Tensor]
    ) -> None:
        super().__init__(model, table, keep)
        cfg = model.config
        fields = _panel_fields(model.lm_head_blocks, cfg.vocab_size, keep)
        if fields is not None and model.lm_head_blocks is not None:
            self.head = torch.tensor(fields, dtype=torch.int64)
            self.head_vocab = model.lm_head_blocks.shape[0]

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> FusedPanelStep | None:
        """The fused step for ``model``, or None where it would not compute the same layers."""
        first = next(model.parameters())
        lib = cpu.load()
        if first.device.type != "cpu" or first.dtype != torch.float32 or lib is None:
            return None
        if model.model.norm.weight.dtype != torch.float32:
            return None
        keep: list[torch.Tensor] = []
        rows = [_layer_row(cast("LlamaDecoderLayer", layer), keep) for layer in model.model.layers]
        if not rows or any(r is None for r in rows):
            return None
        step = cls(model, torch.tensor(rows, dtype=torch.int64), keep)
        if not lib.panel_step_supported(step.dims.data_ptr()):
            return None
        return step

    def head_serves(self, num_rows: int) -> bool:
        """Whether the fused call also runs the LM head for ``num_rows`` sampled rows."""
        return self.head is not None and 0 < num_rows <= MAX_ROWS

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        sample_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Final hidden states ``[T, hidden]`` of the step, its K/V written to the caches, and
        the float32 logits of ``hidden[sample_rows]`` when asked and the head is in panels
        (else None: the caller runs the head); None (nothing written) where the native call
        declines."""
        lib = cpu.load()
        if lib is None:
            return None
        return run_native_step(
            self, lib.panel_step, (torch.float32, torch.int8, torch.float16), torch.float32,
            input_ids, positions, kv_caches, meta, sample_rows,
        )  # fmt: skip
