"""A small float32 step's inputs written into persistent host buffers for the fused native call.

One stream decoding runs a ~5 ms native step per token; around it, the model runner used to build
eight small tensors (ids, positions, the attention metadata's slots, starts, lengths and block
table, the rows to sample) and the fused call converted them and ran the embedding, about two
dozen PyTorch calls a step. Right after a step that has streamed the weights through the caches
every one of them runs cold, and together they cost about as much as a tenth of the forward.
:class:`HostStep` keeps one buffer per input, allocated once, and writes a step's numbers into
them through NumPy views of the same memory; the embedding rows are copied in as raw bytes. The
native call then gets the same pointers' worth of the same values as
:func:`engine.models.fused_step.run_native_step` would hand it, so the step computes the same
bits (``tests/engine/test_host_step.py``).

It serves the float32 panel step (:class:`~engine.models.panel_step.FusedPanelStep`, the
``--dtype auto`` default on CPU) when the head runs inside the call; any other step, or one it
cannot take (more than :data:`MAX_ROWS` tokens, a block table wider than its buffer, a length
out of range, a cache that moved), returns None before anything is written and the runner takes
its general path. Like the CUDA graphs' buffers, it is bound to the runner's KV caches and holds
the hidden states and the logits of the last step only: a step's logits are read (sampled)
before the next step runs. Not thread-safe: one step at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.kernels import cpu
from engine.models.fused_step import MAX_ROWS, call_native
from engine.models.llama import LlamaForCausalLM
from engine.models.panel_step import FusedPanelStep

_CACHE_DTYPES = (torch.float32, torch.int8, torch.float16)  # what FusedPanelStep.run takes


class HostStep:
    """Persistent inputs of the fused panel step for steps of at most :data:`MAX_ROWS` tokens."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        step: FusedPanelStep,
        kv_caches: list[torch.Tensor],
        max_blocks: int,
    ) -> None:
        if step.head is None:
            raise ValueError("the host step needs the LM head inside the fused call")
        self.model = model
        self.step = step
        self.head = step.head
        self.kv_caches = kv_caches
        self.cache_ids = tuple(map(id, kv_caches))
        self.cache_ptrs = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64)
        _, self.num_blocks, self.block_size, _, _ = kv_caches[0].shape
        self.kv_kind = cpu.kv_kind(kv_caches[0].dtype, torch.float32)
        self.max_blocks = max_blocks
        weight = model.model.embed_tokens.weight.detach()
        hidden = weight.shape[1]
        self.x = torch.zeros(MAX_ROWS, hidden, dtype=weight.dtype)
        self.out = torch.zeros(MAX_ROWS, hidden, dtype=weight.dtype)
        # Raw bytes: a row copied is the row embedding() gathers, whatever the dtype.
        self.embed_bytes = weight.view(torch.uint8).numpy()
        self.x_bytes = self.x.view(torch.uint8).numpy()
        self.ids = np.zeros(MAX_ROWS, dtype=np.int64)
        self.positions = torch.zeros(MAX_ROWS, dtype=torch.int64)
        self.slots = torch.zeros(MAX_ROWS, dtype=torch.int64)
        self.starts = torch.zeros(MAX_ROWS + 1, dtype=torch.int32)
        self.lens = torch.zeros(MAX_ROWS, dtype=torch.int32)
        self.rows = torch.zeros(MAX_ROWS, dtype=torch.int32)
        self.tables = torch.zeros(MAX_ROWS * max_blocks, dtype=torch.int32)
        self.np = {
            name: getattr(self, name).numpy()
            for name in ("positions", "slots", "starts", "lens", "rows", "tables")
        }
        # The logits rows too: the same tensor for a step of n rows every time, rewritten by
        # each call (the sampler reads them within the step; see Sampler._host_view).
        self.logits = torch.zeros(MAX_ROWS, step.head_vocab, dtype=torch.float32)
        self.logits_rows = [self.logits[:n] for n in range(MAX_ROWS + 1)]

    @classmethod
    def build(
        cls, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_blocks: int
    ) -> HostStep | None:
        """The host step for ``model`` over ``kv_caches``, or None where it would not serve:
        no float32 panel step with its head inside, or caches the call does not take."""
        step = getattr(model, "fused_step", None)
        if not isinstance(model, LlamaForCausalLM) or not isinstance(step, FusedPanelStep):
            return None
        if step.head is None or not kv_caches or kv_caches[0].dtype not in _CACHE_DTYPES:
            return None
        if not all(c.is_contiguous() and c.device.type == "cpu" for c in kv_caches):
            return None
        weight = model.model.embed_tokens.weight
        if weight.device.type != "cpu" or not weight.is_contiguous():
            return None
        return cls(model, step, kv_caches, max_blocks)

    def run(
        self,
        token_ids: Sequence[int],
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        tables: Sequence[Sequence[int]],
        sample_rows: Sequence[int],
    ) -> torch.Tensor | None:
        """The float32 logits ``[len(sample_rows), vocab]`` of the step whose new tokens are
        ``token_ids`` (request ``i`` owns the next ``query_lens[i]`` of them, the last positions
        of its ``seq_lens[i]``), its K/V written to the caches; None, with nothing written,
        where this step cannot take it (the caller runs the general path). The logits are this
        step's buffer: the next call overwrites them."""
        num_tokens, num_reqs, num_rows = len(token_ids), len(seq_lens), len(sample_rows)
        width = max(map(len, tables))
        if not (0 < num_tokens <= MAX_ROWS and 0 < num_rows <= MAX_ROWS):
            return None
        if width > self.max_blocks or self.model.fused_step is not self.step:
            return None
        if tuple(map(id, self.kv_caches)) != self.cache_ids:
            return None
        block_size = self.block_size
        positions, slots, table_flat = self.np["positions"], self.np["slots"], self.np["tables"]
        starts = self.np["starts"]
        at = 0
        for i, (q_len, s_len, table) in enumerate(zip(query_lens, seq_lens, tables, strict=True)):
            if q_len < 1 or q_len > s_len or len(table) * block_size < s_len:
                return None  # the general path names the problem
            starts[i] = at
            for p in range(s_len - q_len, s_len):
                positions[at] = p
                slots[at] = table[p // block_size] * block_size + p % block_size
                at += 1
            row = table_flat[i * width : (i + 1) * width]
            row[: len(table)] = table
            row[len(table) :] = 0
        starts[num_reqs] = at
        self.np["lens"][:num_reqs] = seq_lens
        self.np["rows"][:num_rows] = sample_rows
        self.ids[:num_tokens] = token_ids
        self.x_bytes[:num_tokens] = self.embed_bytes[self.ids[:num_tokens]]
        logits = self.logits_rows[num_rows]
        lib = cpu.load()
        if lib is None:
            return None
        status = call_native(
            lib.panel_step, self.step, self.x, self.out, num_tokens, self.positions.data_ptr(),
            self.slots.data_ptr(), self.cache_ptrs.data_ptr(), self.kv_kind, self.num_blocks,
            block_size, self.tables.data_ptr(), width, self.starts.data_ptr(),
            self.lens.data_ptr(), num_reqs, self.head.data_ptr(), self.rows.data_ptr(), num_rows,
            logits.data_ptr(),
        )  # fmt: skip
        return logits if status == 0 else None
