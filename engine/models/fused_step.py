"""The whole forward pass of a small step in one native call (``csrc/decode_step.c``).

One stream decoding runs one token per step through 30 layers of ~10 small kernels each. From
Python every kernel pays the interpreter, a tensor allocation and an OpenMP wake-up, which on
the default model added up to about as much as the arithmetic. :class:`FusedDecodeStep` hands
the native library one table of every layer's weights once, and each step of at most
:data:`MAX_ROWS` tokens then runs embedding-to-final-norm in one call, and the LM head on the
rows to sample from when it is in int8 blocks too (:meth:`LlamaForCausalLM.forward_and_logits`).

It serves a model only where that call computes the same layers the Python path would with
int8 activations: bfloat16 on a CPU whose native kernels have the int8 linears (AVX512-VNNI, or
AVX2 with FMA and F16C: ``cpu.int8_available()``), every
projection in GGUF Q4_1/Q8_0 blocks packed for them (``--gguf-activations int8``), and sizes
the kernels take (widths a multiple of 64, head_dim a multiple of 32). LoRA steps that carry
adapter rows use the Python path (the fused call has no adapter deltas), as does every rank of
a tensor-parallel engine (no all-reduce inside). Its KV cache is bfloat16 or int8 (the 8-bit
cache's rows quantized and read by the same native code as the Python path's); a float32 or
fp8_e4m3 cache takes the Python path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from engine.kernels import cpu
from engine.models.block_linear import BlockLinear, GGUFBlocks

if TYPE_CHECKING:
    from engine.attention import AttentionMetadata
    from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# Steps of up to this many tokens take either fused call (panel_step.c's MAX_STEP_ROWS too);
# bigger ones run layer by layer, where the dense and unpacked-panel tiles win.
MAX_ROWS = 8
_KIND_CODES = {"q4_1": 0, "q8_0": 1}


def _layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return cast("list[LlamaDecoderLayer]", list(model.model.layers))


def _linear_fields(linear: BlockLinear, keep: list[torch.Tensor]) -> list[int] | None:
    blocks: GGUFBlocks | None = linear.blocks
    if blocks is None or blocks.packed_q8 is None or blocks.kind not in _KIND_CODES:
        return None
    keep.append(blocks.packed_q8)
    bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None
    if bias is not None:
        keep.append(bias)
    bias_ptr = bias.data_ptr() if bias is not None else 0
    return [_KIND_CODES[blocks.kind], blocks.packed_q8.data_ptr(), 0, 0, bias_ptr]


class NativeStep:
    """What both fused steps (:class:`FusedDecodeStep`, the float32 FusedPanelStep) hold and
    do alike: the layer table, the model's sizes and final norm, the cache addresses, and
    when a step takes the fused call. Each sets ``head`` and ``head_vocab`` when its LM head
    runs inside the call.

    Holds references to every tensor whose address the table carries, so they outlive it.
    Not thread-safe (one step at a time, as the model runner calls it).
    """

    def __init__(
        self, model: LlamaForCausalLM, table: torch.Tensor, keep: list[torch.Tensor]
    ) -> None:
        cfg = model.config
        self.model = model
        self.table = table
        self.keep = keep
        self.dims = torch.tensor(
            [cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
             cfg.intermediate_size, cfg.num_hidden_layers],
            dtype=torch.int32,
        )  # fmt: skip
        self.final_norm = model.model.norm.weight.detach().contiguous()
        self.eps = float(model.model.norm.eps)
        self.scale = cfg.head_dim**-0.5
        self._cache_ptrs: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._first_qkv = _layers(model)[0].self_attn.qkv_proj
        self.head: torch.Tensor | None = None
        self.head_vocab = 0

    def serves(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens takes the fused call now (LoRA steps with
        adapter rows do not)."""
        lora = self._first_qkv.lora
        return 0 < num_tokens <= MAX_ROWS and (lora is None or lora.batch.slots is None)

    def head_serves(self, num_rows: int) -> bool:
        """Whether the fused call also runs the LM head for ``num_rows`` sampled rows."""
        raise NotImplementedError

    def _caches(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The caches' addresses as the native call takes them (rebuilt if they moved)."""
        key = tuple(c.data_ptr() for c in kv_caches)
        if self._cache_ptrs is None or self._cache_ptrs[0] != key:
            self._cache_ptrs = (key, torch.tensor(key, dtype=torch.int64))
        return self._cache_ptrs[1]


def call_native(
    entry: Callable[..., int],
    step: NativeStep,
    x: torch.Tensor,
    out: torch.Tensor,
    *per_step: int | float | None,
) -> int:
    """``entry`` (``decode_step`` or ``panel_step``) called with ``step``'s fixed arguments (the
    layer table, sizes, final norm, scale, rotary tables, thread count) around ``per_step``:
    the token count, then the positions' through the logits' arguments in the native order
    (``csrc/panel_step.c``). The one place that spells the call; returns its status."""
    num_tokens, *rest = per_step
    rotary = step.model.rotary_emb
    return entry(
        step.table.data_ptr(), step.dims.data_ptr(), step.final_norm.data_ptr(), step.eps,
        step.scale, x.data_ptr(), out.data_ptr(), num_tokens, rotary.cos.data_ptr(),
        rotary.sin.data_ptr(), *rest, torch.get_num_threads(),
    )  # fmt: skip


def run_native_step(
    step: NativeStep,
    entry: Callable[..., int],
    cache_dtypes: tuple[torch.dtype, ...],
    logits_dtype: torch.dtype,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
    sample_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One fused step through ``entry`` (``decode_step`` or ``panel_step`` of the native
    library: the same arguments): the final hidden states and the logits of ``sample_rows``
    in ``logits_dtype`` when the step's head serves them; None (nothing written) for a cache
    outside ``cache_dtypes``, a cache that is not contiguous, or a declining native call."""
    cache_dtype = kv_caches[0].dtype
    if cache_dtype not in cache_dtypes or not all(c.is_contiguous() for c in kv_caches):
        return None
    x = step.model.model.embed_tokens(input_ids).contiguous()
    out = torch.empty_like(x)
    pos = positions.to(torch.int64).contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    tables = meta.block_tables.to(torch.int32).contiguous()
    starts = meta.query_start_loc.to(torch.int32).contiguous()
    lens = meta.seq_lens.to(torch.int32).contiguous()
    _, num_blocks, block_size, _, _ = kv_caches[0].shape
    head, rows, logits = None, None, None
    if sample_rows is not None and step.head_serves(sample_rows.numel()):
        head = step.head
        rows = sample_rows.to(torch.int32).contiguous()
        logits = torch.empty((rows.numel(), step.head_vocab), dtype=logits_dtype)
    status = call_native(
        entry, step, x, out, x.shape[0], pos.data_ptr(), slots.data_ptr(),
        step._caches(kv_caches).data_ptr(), cpu.kv_kind(cache_dtype, x.dtype), num_blocks,
        block_size, tables.data_ptr(), tables.shape[1], starts.data_ptr(), lens.data_ptr(),
        lens.shape[0], head.data_ptr() if head is not None else None,
        rows.data_ptr() if rows is not None else None,
        rows.numel() if rows is not None else 0,
        logits.data_ptr() if logits is not None else None,
    )  # fmt: skip
    return None if status != 0 else (out, logits)


class FusedDecodeStep(NativeStep):
    """A bfloat16 int8-blocks model's layer table for the native fused step, built once
    (:meth:`build`)."""

    def __init__(
        self, model: LlamaForCausalLM, table: torch.Tensor, keep: list[torch.Tensor]
    ) -> None:
        super().__init__(model, table, keep)
        # The LM head, when its int8 block kernel is what compute_logits would call.
        head = model.lm_head_blocks
        self.head_max_rows = 0
        if head is not None and head.packed_q8 is not None and head.kind in _KIND_CODES:
            self.keep.append(head.packed_q8)
            fields = [_KIND_CODES[head.kind], head.packed_q8.data_ptr(), head.shape[0]]
            self.head = torch.tensor(fields, dtype=torch.int64)
            self.head_max_rows, self.head_vocab = head.max_rows, head.shape[0]

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> FusedDecodeStep | None:
        """The fused step for ``model``, or None where it would not compute the same layers."""
        first = next(model.parameters())
        if first.device.type != "cpu" or first.dtype != torch.bfloat16:
            return None
        lib = cpu.load()
        if lib is None:
            return None
        rows: list[list[int]] = []
        keep: list[torch.Tensor] = []
        for layer in _layers(model):
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            fields = [_linear_fields(linear, keep) for linear in linears]
            if any(f is None for f in fields):
                return None
            norms = [
                layer.input_layernorm.weight.detach().contiguous(),
                layer.post_attention_layernorm.weight.detach().contiguous(),
            ]
            keep.extend(norms)
            row = [norms[0].data_ptr(), norms[1].data_ptr()]
            for f in fields:
                row.extend(f or [])
            rows.append(row)
        step = cls(model, torch.tensor(rows, dtype=torch.int64), keep)
        if not lib.decode_step_supported(step.dims.data_ptr()):
            return None
        return step

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        sample_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Final hidden states ``[T, hidden]`` of the step, its K/V written to the caches, and
        the float32 logits of ``hidden[sample_rows]`` when asked and the head's int8 kernel
        serves them (:meth:`head_serves`; else None: the caller runs the head); None (nothing
        written) where the native call declines."""
        lib = cpu.load()
        if lib is None:
            return None
        done = run_native_step(
            self, lib.decode_step, (torch.bfloat16, torch.int8), torch.bfloat16,
            input_ids, positions, kv_caches, meta, sample_rows,
        )  # fmt: skip
        if done is None:
            return None
        out, logits = done
        # bf16 logits widened, as compute_logits returns the head's bf16 products
        return out, logits.float() if logits is not None else None

    def head_serves(self, num_rows: int) -> bool:
        """Whether the fused call also runs the LM head for ``num_rows`` sampled rows (where
        compute_logits would run the same int8 kernel)."""
        return self.head is not None and 0 < num_rows <= self.head_max_rows
