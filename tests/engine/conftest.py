"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.model_loader import LoadedModel, load_model
from portico.registry import ModelSource


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module's tests: the two cores are shared with the
    engine processes and tests running beside them, and more threads than free cores stall
    every op on OpenMP barriers."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    """The tiny random Llama loaded in float32 on the CPU (a module may define its own)."""
    return load_model(ModelSource("tiny", tiny_llama_dir, "hf"), torch.float32, "cpu")
