"""The decode buffers' pieces for asynchronous scheduling (engine/cuda_graphs.py): placeholder
rows whose input token is the previous step's sampled id, copied on the device, and the
staging sets. On CPU through the graph runner's eager path over the same buffers."""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import DecodeBuffers, DecodeGraphs, DecodeStep
from engine.model_loader import LoadedModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 4
SCRATCH = 9  # blocks 0..8 belong to requests; 9 is the padding rows' scratch block


def test_placeholder_rows_take_the_previous_steps_ids_on_the_device() -> None:
    buffers = DecodeBuffers(8, 4, BLOCK_SIZE, SCRATCH, torch.device("cpu"))
    sampled = torch.tensor([101, 102, 103], dtype=torch.int64)  # last step's rows 0, 1, 2
    step = DecodeStep([-1, 55, -1], [3, 7, 1], [4, 8, 2], [[0], [1, 2], [3]], [2, -1, 0])
    buffers.load(step, 4, sampled)
    assert buffers.input_ids[:4].tolist() == [103, 55, 101, 0]  # padding row: token 0
    assert buffers.positions[:3].tolist() == [3, 7, 1]
    # a later step without placeholders overwrites them like any other row
    buffers.load(DecodeStep([7, 8], [0, 0], [1, 1], [[4], [5]]), 2)
    assert buffers.input_ids[:2].tolist() == [7, 8]
    # every row known on the host: no sampled ids needed
    buffers.load(DecodeStep([9], [0], [1], [[4]], [-1]), 1)
    assert buffers.input_ids[:1].tolist() == [9]


def test_placeholders_are_refused_without_ids_or_out_of_their_range() -> None:
    buffers = DecodeBuffers(4, 2, BLOCK_SIZE, SCRATCH, torch.device("cpu"))
    step = DecodeStep([-1], [0], [1], [[0]], [0])
    with pytest.raises(ValueError, match="needs the previous sampled ids"):
        buffers.load(step, 1)
    with pytest.raises(ValueError, match="past the 2 sampled ids"):
        buffers.load(DecodeStep([-1], [0], [1], [[0]], [2]), 1, torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="one entry per row"):
        buffers.load(DecodeStep([-1, 3], [0, 0], [1, 1], [[0], [1]], [0]), 2, torch.tensor([4]))
    with pytest.raises(ValueError, match="staging_sets"):
        DecodeBuffers(4, 2, BLOCK_SIZE, SCRATCH, torch.device("cpu"), staging_sets=0)
    # on CPU the staging is the buffers themselves: one set whatever is asked
    cpu = DecodeBuffers(4, 2, BLOCK_SIZE, SCRATCH, torch.device("cpu"), staging_sets=2)
    assert cpu.staging_sets == 1


def _two_steps(
    tiny: LoadedModel, placeholders: bool
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Step 1: three requests' first tokens; step 2: the same requests in another order plus
    a new one, each old request's input being its step-1 greedy token, given as placeholders
    (read on the device) or as host ids. Returns both steps' logits and the KV caches."""
    cfg = tiny.config
    kv = [
        torch.zeros(2, SCRATCH + 1, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        for _ in range(cfg.num_hidden_layers)
    ]
    buffers = DecodeBuffers(4, 2, BLOCK_SIZE, SCRATCH, tiny.device)
    graphs = DecodeGraphs(tiny.model, kv, buffers, [1, 2, 4])
    _, first = graphs.run(DecodeStep([5, 9, 13], [0, 0, 0], [1, 1, 1], [[0], [1], [2]]))
    sampled = first.argmax(dim=-1)  # stays on the device; never read on the host here
    order = [2, 0, 1]
    if placeholders:
        step = DecodeStep([-1, -1, -1, 40], [1, 1, 1, 0], [2, 2, 2, 1], [[2], [0], [1], [3]],
                          [*order, -1])  # fmt: skip
        _, second = graphs.run(step, sampled)
    else:
        ids = sampled.tolist()
        step = DecodeStep([ids[i] for i in order] + [40], [1, 1, 1, 0], [2, 2, 2, 1],
                          [[2], [0], [1], [3]])  # fmt: skip
        _, second = graphs.run(step)
    return first.clone(), second.clone(), kv


def test_a_step_fed_from_device_ids_equals_the_step_fed_from_host_ids(tiny: LoadedModel) -> None:
    first_a, second_a, kv_a = _two_steps(tiny, placeholders=True)
    first_b, second_b, kv_b = _two_steps(tiny, placeholders=False)
    assert torch.equal(first_a, first_b)
    assert torch.equal(second_a, second_b)
    for a, b in zip(kv_a, kv_b, strict=True):  # the placeholder tokens' K/V, written alike
        assert torch.equal(a, b)
    # a placeholder left unresolved would leave the load's token there: the ids differ from it
    assert all(t != -1 and t != 0 for t in first_a.argmax(dim=-1).tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_staging_sets_alternate_on_cuda() -> None:
    buffers = DecodeBuffers(4, 2, BLOCK_SIZE, SCRATCH, torch.device("cuda"), staging_sets=2)
    assert buffers.staging_sets == 2
    buffers.load(DecodeStep([1], [0], [1], [[0]]), 1)
    first = buffers._host_i64
    sampled = torch.tensor([77], device="cuda")
    buffers.load(DecodeStep([-1], [1], [2], [[0]], [0]), 1, sampled)  # while step 1 "runs"
    assert buffers._host_i64 is not first
    assert buffers.input_ids[:1].tolist() == [77]
    assert first[0, 0] == 1  # step 1's staged row was not overwritten
