"""The streamed CPU memory on transparent huge pages: the same values at other addresses, in one
region where gathered, and advised for huge pages where the system has them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.kernels.huge_pages import HUGE_PAGE, gather_on_huge_pages, huge_buffer, huge_zeros
from engine.model_loader import LoadedModel, load_model
from engine.models.block_linear import BlockLinear
from portico.registry import resolve

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The selected transparent huge page mode (``always``, ``madvise``, ``never``), if any."""
    try:
        found = re.search(r"\[(\w+)\]", _THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _vma_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_huge_zeros_are_zeros_of_the_shape_and_dtype() -> None:
    for dtype in (torch.float32, torch.int8, torch.bfloat16):
        t = huge_zeros((2, 40, 16, 3, 64), dtype)
        assert t.shape == (2, 40, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
        t.fill_(1)  # writable
        assert int(t.sum().item()) == t.numel()


def test_a_large_buffer_starts_on_a_huge_page_and_is_advised_for_them() -> None:
    buf = huge_buffer(3 * HUGE_PAGE + 5)
    assert buf.numel() == 3 * HUGE_PAGE + 5 and buf.data_ptr() % HUGE_PAGE == 0
    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"no transparent huge pages here ({_thp_mode()})")
    flags = _vma_flags(buf.data_ptr())
    assert "hg" in flags["VmFlags"].split(), flags["VmFlags"]  # MADV_HUGEPAGE took
    small = huge_buffer(4096)  # under a huge page: ordinary memory
    assert small.numel() == 4096 and not small.any()


def test_gathered_tensors_equal_their_sources_one_after_another() -> None:
    gen = torch.Generator().manual_seed(3)
    sources = [
        torch.randn(1000, generator=gen),
        torch.randint(0, 255, (7,), dtype=torch.uint8, generator=gen),
        torch.randint(-(2**40), 2**40, (300_000,), dtype=torch.int64, generator=gen),
        torch.randn(3, 5, generator=gen).half(),
    ]
    gathered = gather_on_huge_pages(sources)
    for src, copy in zip(sources, gathered, strict=True):
        assert copy.dtype == src.dtype and copy.shape == src.shape and torch.equal(copy, src)
        assert copy.data_ptr() != src.data_ptr() and copy.data_ptr() % 64 == 0
    ptrs = [t.data_ptr() for t in gathered]
    assert ptrs == sorted(ptrs)  # in order, in one region
    assert ptrs[-1] - ptrs[0] < 8 * 300_000 + 8192
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        gather_on_huge_pages([torch.randn(4, 4).t()])


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> LoadedModel:
    return load_model(resolve(str(smollm2_gguf)), torch.float32, "cpu", "gguf")


def test_the_default_models_panels_lie_in_step_order_in_one_region(smollm2: LoadedModel) -> None:
    model = smollm2.model
    panels = [
        m.blocks.panels
        for m in model.modules()
        if isinstance(m, BlockLinear) and m.blocks is not None and m.blocks.panels is not None
    ]
    assert model.lm_head_blocks is not None and model.lm_head_blocks.panels is not None
    panels.append(model.lm_head_blocks.panels)
    assert len(panels) == 4 * model.config.num_hidden_layers + 1
    # qkv, o, gate/up, down of layer 0, then of layer 1, ..., the head last: back to back
    for before, after in zip(panels, panels[1:], strict=False):
        end = before.data_ptr() + before.numel()
        assert 0 <= after.data_ptr() - end < 64
    assert panels[0].data_ptr() % HUGE_PAGE == 0
    # the fused step reads these very bytes
    table = model.fused_step.table
    assert int(table[0].tolist().count(panels[0].data_ptr())) == 1
