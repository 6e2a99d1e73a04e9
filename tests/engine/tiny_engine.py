"""An LLMEngine over the tiny random Llama, and a loop that runs it dry: shared by the engine
tests that drive ``LLMEngine`` step by step."""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel
from engine.outputs import RequestOutput


def make_engine(loaded: LoadedModel, **overrides: Any) -> LLMEngine:
    fields: dict[str, Any] = {"model": "tiny", "device": "cpu", "num_gpu_blocks_override": 256}
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields), loaded)


def run_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle; return each request's final output (exactly one per request)."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
    return final
