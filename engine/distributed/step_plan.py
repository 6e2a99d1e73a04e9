"""What rank 0 tells the workers each step, as two broadcasts of int64 tensors.

A header of :data:`HEADER` numbers (the kind, then sizes), then a payload whose layout the
header fixes. ``RUN``: the flattened batch the model runs, i.e. input ids, positions, slot
mapping, query start offsets, sequence lengths and block tables (the sampled rows stay on
rank 0, the only rank that computes logits). ``SWAP``: block pairs to copy between the device
cache and the CPU swap pool. ``STOP``: leave the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.distributed.group import TensorParallelGroup

RUN, SWAP, STOP = 1, 2, 3
HEADER = 6  # kind, then RUN: tokens, requests, table width, max query len, max seq len


@dataclass
class RunPlan:
    """The model's inputs for one step, on the receiving rank's device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@dataclass
class SwapPlan:
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]


class StopPlan:
    """The engine is closing: workers leave their loop and exit."""


def _send(group: TensorParallelGroup, header: list[int], payload: torch.Tensor | None) -> None:
    group.broadcast(torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64))
    if payload is not None and payload.numel():
        group.broadcast(payload.contiguous())


def send_run(
    group: TensorParallelGroup,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Rank 0: broadcast the batch it is about to run."""
    tables = meta.block_tables
    header = [RUN, input_ids.numel(), meta.num_reqs, tables.shape[1], meta.max_query_len,
              meta.max_seq_len]  # fmt: skip
    parts = (input_ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, tables)
    payload = torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts])
    _send(group, header, payload)


def send_swap(
    group: TensorParallelGroup, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
) -> None:
    pairs = [x for pair in swap_out + swap_in for x in pair]
    _send(group, [SWAP, len(swap_out), len(swap_in)], torch.tensor(pairs, dtype=torch.int64))


def send_stop(group: TensorParallelGroup) -> None:
    _send(group, [STOP], None)


def receive(group: TensorParallelGroup) -> RunPlan | SwapPlan | StopPlan:
    """A worker: wait for rank 0's next plan (as long as the engine stays idle)."""
    header = group.broadcast(torch.zeros(HEADER, dtype=torch.int64)).tolist()
    kind = header[0]
    if kind == STOP:
        return StopPlan()
    if kind == SWAP:
        num_out, num_in = header[1], header[2]
        flat = torch.zeros(2 * (num_out + num_in), dtype=torch.int64)
        if flat.numel():
            group.broadcast(flat)
        pairs = [(int(a), int(b)) for a, b in flat.view(-1, 2).tolist()]
        return SwapPlan(pairs[:num_out], pairs[num_out:])
    if kind != RUN:
        raise RuntimeError(f"unknown step plan kind {kind}")
    tokens, reqs, width, max_query_len, max_seq_len = header[1:]
    sizes = [tokens, tokens, tokens, reqs + 1, reqs, reqs * width]
    payload = group.broadcast(torch.zeros(sum(sizes), dtype=torch.int64))
    ids, pos, slots, starts, seq_lens, tables = payload.split(sizes)
    device = group.device
    query_lens = (starts[1:] - starts[:-1]).tolist()
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=starts.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        block_tables=tables.view(reqs, width).to(device=device, dtype=torch.int32),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens.tolist(),
    )
    return RunPlan(ids.to(device), pos.to(device), meta)
