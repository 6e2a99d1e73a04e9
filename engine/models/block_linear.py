"""Linear layers that can also keep their weights in GGUF's block formats (Q4_1, Q8_0).

A decode step with a few rows reads every weight once and does little arithmetic with it, so on
a CPU its speed is the speed at which weights stream from memory. :class:`BlockLinear` keeps the
dense weight (for big batches, where the matrix units win) and, when the model came from a GGUF
file with ``quantization="gguf"``, the file's own blocks as well: steps of at most
:attr:`GGUFBlocks.max_rows` rows then run the native block kernels
(:func:`engine.kernels.quantized_linear`), reading 0.75 (Q4_1) or 1.125 (Q8_0) bytes per
weight instead of 2 (bf16) or 4 (fp32). The blocks hold exactly the values the dense weight was
dequantized from, so both paths compute the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine import kernels
from engine.kernels import cpu
from engine.models.fp8_linear import Fp8Weight, fp8_linear

if TYPE_CHECKING:
    from engine.lora.manager import LoRALinear

# Rows up to which the block kernel beats the dense matmul on the CPUs measured (AMX bf16):
# measured with load/forward_bench.py, see docs/engine-benchmark.md.
_MAX_ROWS = {"q4_1": 8, "q8_0": 4}
# Measured on an AVX2 EPYC (2 threads, SmolLM2's gate/up): int8 blocks 21.2 GMAC/s at 64 rows,
# 19.9 at 128; the float32 matmul 21.4 and 23.4 (docs/engine-benchmark.md).
_MAX_ROWS_INT8_NO_BF16 = 64
_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
_PANEL = 16  # output rows per panel of the batch invariant kernel (csrc/panel_linear.c)


@dataclass
class GGUFBlocks:
    """One weight matrix ``[out, in]`` in GGUF blocks of 32 weights along ``in``.

    ``q4_1``: ``qs`` uint8 ``[out, in / 2]`` (a block's 16 bytes: low nibbles are weights 0-15,
    high nibbles 16-31), ``scales`` and ``mins`` float32 ``[out, in / 32]``; w = scale * q + min.
    ``q8_0``: ``qs`` int8 ``[out, in]``, ``scales`` ``[out, in / 32]``; w = scale * q.

    ``packed_q8``: the same weights repacked for the int8-activation kernel
    (:func:`engine.kernels.pack_blocks_q8`); when set, bfloat16 inputs are rounded to int8 per
    block of 32 values before the products (llama.cpp's way; faster, not exact:
    docs/engine-benchmark.md measures it). Set by the loader with ``--gguf-activations int8``;
    float32 inputs are always exact.
    """

    kind: str
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    packed_q8: torch.Tensor | None = None
    panels: torch.Tensor | None = None

    @property
    def max_rows(self) -> int:
        """Rows up to which a step runs on these blocks. With int8 activations on a CPU without
        bfloat16 arithmetic, up to 64: there the int8 block kernel beats the float32 copy of the
        weight (:func:`engine.kernels.prepack_linear_weight`) up to about 64 rows."""
        if self.packed_q8 is not None and not cpu.bf16_matmul_native():
            return _MAX_ROWS_INT8_NO_BF16
        return _MAX_ROWS[self.kind]

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * 32

    def pack_q8(self) -> bool:
        """Attach :attr:`packed_q8` (int8 activations from now on); False where no kernel
        serves these blocks, which then stay exact."""
        self.packed_q8 = kernels.pack_blocks_q8(self.kind, self.qs, self.scales, self.mins)
        return self.packed_q8 is not None

    def pack_panels(self) -> None:
        """Attach :attr:`panels`: the blocks repacked for the batch invariant kernel
        (csrc/panel_linear.c) as one uint8 tensor of records: output rows in panels of 16 (the
        last padded with zero weights), for each panel each block in input order, the block's
        quants 4 inputs x 16 rows at a time (a row's 4 bytes side by side; Q4_1: a byte holds
        inputs j and j + 16, as in the file; Q8_0: one input, offset by 128 to unsigned), then
        the 16 rows' scales and (Q4_1) minimums as float16, as the file stores them. From then
        on every step of this linear runs on them. Raises ``ValueError`` for scales that are
        not float16 values."""
        out, k = self.shape
        num_panels, blocks = -(-out // _PANEL), k // 32
        pad = num_panels * _PANEL - out

        def padded(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t

        per_block = 16 if self.kind == "q4_1" else 32
        quants = self.qs.view(torch.uint8)
        if self.kind == "q8_0":
            quants = quants ^ 0x80  # signed to unsigned: the integer kernels' weight operand
        grid = padded(quants).view(num_panels, _PANEL, blocks, per_block // 4, 4)
        parts = [grid.permute(0, 2, 3, 1, 4).reshape(num_panels, blocks, per_block * _PANEL)]
        for values in (self.scales, self.mins):
            if values is None:
                continue
            half = values.half()
            if not torch.equal(half.float(), values.float()):
                raise ValueError("GGUF block scales and minimums must be float16 values")
            by_panel = padded(half).view(num_panels, _PANEL, blocks).permute(0, 2, 1).contiguous()
            parts.append(by_panel.view(torch.uint8))
        self.panels = torch.cat(parts, dim=2).reshape(-1)

    @classmethod
    def from_raw(cls, kind: str, raw: np.ndarray) -> GGUFBlocks:
        """Split a GGUF tensor's raw bytes (``[out, in / 32 * block bytes]`` uint8) into arrays."""
        if kind not in _BLOCK_BYTES:
            raise ValueError(f"GGUF block kind must be one of {sorted(_BLOCK_BYTES)}; got '{kind}'")
        rows = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(rows, -1, _BLOCK_BYTES[kind])
        per_row = blocks.shape[1]

        def half_floats(start: int) -> torch.Tensor:
            data = np.ascontiguousarray(blocks[:, :, start : start + 2]).view(np.float16)
            return torch.from_numpy(data.astype(np.float32).reshape(rows, per_row))

        if kind == "q4_1":
            qs = np.ascontiguousarray(blocks[:, :, 4:]).reshape(rows, per_row * 16)
            return cls(kind, torch.from_numpy(qs), half_floats(0), half_floats(2))
        qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, per_row * 32)
        return cls(kind, torch.from_numpy(qs), half_floats(0))

    def rows(self, index: torch.Tensor | slice) -> GGUFBlocks:
        """The blocks of output rows ``index`` (a permutation or a slice)."""
        mins = self.mins[index] if self.mins is not None else None
        return GGUFBlocks(self.kind, self.qs[index], self.scales[index], mins)

    @staticmethod
    def concat(parts: list[GGUFBlocks]) -> GGUFBlocks:
        """Rows of ``parts`` stacked (q/k/v into qkv, gate/up into gate_up); one kind only."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack GGUF blocks of different kinds {sorted(kinds)}")
        mins = [p.mins for p in parts if p.mins is not None]
        return GGUFBlocks(
            parts[0].kind,
            torch.cat([p.qs for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat(mins) if len(mins) == len(parts) else None,
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` these blocks encode (for tests and checks)."""
        out, in_features = self.shape
        if self.kind == "q4_1":
            low = (self.qs & 0x0F).view(out, -1, 16)
            high = (self.qs >> 4).view(out, -1, 16)
            q = torch.cat([low, high], dim=-1).float()  # [out, blocks, 32]
            w = q * self.scales[..., None] + self.mins[..., None]  # type: ignore[index]
        else:
            w = self.qs.view(out, -1, 32).float() * self.scales[..., None]
        return w.reshape(out, in_features)


def block_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    blocks: GGUFBlocks | None,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias``: through ``blocks`` when they are set, ``x`` has few enough rows
    and a block kernel serves it (:func:`engine.kernels.quantized_linear`); else through the
    ``packed`` weight (:func:`engine.kernels.prepack_linear_weight`: oneDNN's up to
    :data:`engine.kernels.PACKED_MAX_ROWS` rows, a float32 copy at any); else the dense
    matmul."""
    rows = x.shape[0]
    if blocks is not None and blocks.panels is not None and rows > 0:
        # every step, whatever its size: the same chain of operations for each output element
        bias32 = bias.float() if bias is not None else None
        out = kernels.quantized_linear(
            x, blocks.kind, blocks.qs, blocks.scales, blocks.mins, bias32, panels=blocks.panels
        )
        if out is not None:
            return out
    if blocks is not None and 0 < rows <= blocks.max_rows:
        bias32 = bias.float() if bias is not None else None
        out = kernels.quantized_linear(
            x, blocks.kind, blocks.qs, blocks.scales, blocks.mins, bias32, blocks.packed_q8
        )
        if out is not None:
            return out
    if packed is not None:
        packed_out = kernels.prepacked_linear(x, packed, bias)
        if packed_out is not None:
            return packed_out
    return kernels.linear(x, weight, bias)


class BlockLinear(nn.Linear):
    """``nn.Linear`` that uses its :class:`GGUFBlocks` (when attached) for small batches and
    its prepacked weight (when attached, bf16 on CPU: oneDNN's, or a float32 copy) for the
    others; or, with ``--quantization fp8``, only its e4m3 weight
    (:mod:`engine.models.fp8_linear`; the dense weight is then dropped)."""

    blocks: GGUFBlocks | None = None
    packed: torch.Tensor | None = None
    fp8: Fp8Weight | None = None  # set by engine.models.fp8_linear.quantize_projections
    lora: LoRALinear | None = None  # set by engine.lora.manager.LoRAManager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            out = fp8_linear(x, self.fp8, self.bias)
        elif self.blocks is None and self.packed is None:
            out = kernels.linear(x, self.weight, self.bias)
        else:
            out = block_matmul(x, self.weight, self.blocks, self.bias, self.packed)
        if self.lora is not None:  # each row's adapter delta, on top of whichever base path ran
            self.lora.add_delta(x, out)
        return out
