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


@pytest.fixture(scope="session")
def smollm2_float32(smollm2_gguf: Path) -> LoadedModel:
    """The default model's GGUF loaded dense in float32 on the CPU, once for the session (the
    modules comparing it with references each loaded it). Engines are built on it as on any
    LoadedModel, several per module: they read the weights and never change them."""
    return load_model(ModelSource("smollm2", smollm2_gguf, "gguf"), torch.float32, "cpu")
