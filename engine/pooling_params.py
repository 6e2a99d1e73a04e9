"""How an embedding request pools, and the served model's pooling defaults (no torch here:
the engine's flags read it). The pooling itself is engine/pooling.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
TASKS = ("auto", "generate", "embed")


@dataclass(frozen=True)
class PoolingParams:
    """How one embedding request pools: ``pooling_type`` in :data:`POOLING_TYPES`, L2
    ``normalize``, and ``dimensions`` (keep the first ones, then normalise: Matryoshka).

    ``score_head``: a cross-encoder's pair request; the pooled row goes through the model's
    score head and the result is its logits (``normalize`` and ``dimensions`` do not apply)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None
    score_head: bool = False

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError("dimensions must be at least 1")


@dataclass(frozen=True)
class PoolerConfig:
    """The served model's pooling defaults and which ``dimensions`` it allows.

    From, in order: ``--pooler-config`` (vLLM's JSON: ``pooling_type``, ``normalize``), the
    model folder's sentence-transformers files (``1_Pooling/config.json``), else vLLM's
    default for a decoder-only model: last token, normalised. ``matryoshka_dimensions`` comes
    from the model's config.json (``matryoshka_dimensions`` / ``is_matryoshka``) or the flag.
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    def params(self, dimensions: int | None = None) -> PoolingParams:
        return PoolingParams(self.pooling_type, self.normalize, dimensions)

    def allows_dimensions(self, dimensions: int) -> bool:
        if not self.matryoshka:
            return False
        return not self.matryoshka_dimensions or dimensions in self.matryoshka_dimensions


def load_pooler_config(model_dir: Path | None, flag: str | None) -> PoolerConfig:
    """The pooling of the model at ``model_dir`` (a folder, or None for a GGUF file) with the
    ``--pooler-config`` JSON applied over it. ValueError naming the flag on a bad flag."""
    values: dict[str, Any] = {}
    if model_dir is not None and model_dir.is_dir():
        pooling_file = model_dir / "1_Pooling" / "config.json"
        if pooling_file.is_file():
            st = json.loads(pooling_file.read_text())
            if st.get("pooling_mode_mean_tokens"):
                values["pooling_type"] = "MEAN"
            elif st.get("pooling_mode_cls_token"):
                values["pooling_type"] = "CLS"
            elif st.get("pooling_mode_lasttoken"):
                values["pooling_type"] = "LAST"
        config_file = model_dir / "config.json"
        if config_file.is_file():
            hf = json.loads(config_file.read_text())
            dims = hf.get("matryoshka_dimensions")
            if hf.get("is_matryoshka") or dims:
                values["matryoshka"] = True
                values["matryoshka_dimensions"] = tuple(dims or ())
    if flag:
        try:
            override = json.loads(flag)
        except ValueError:
            raise ValueError(f"--pooler-config must be a JSON object, got {flag!r}") from None
        if not isinstance(override, dict):
            raise ValueError(f"--pooler-config must be a JSON object, got {flag!r}")
        unknown = set(override) - {"pooling_type", "normalize", "matryoshka_dimensions"}
        if unknown:
            raise ValueError(f"--pooler-config: unknown key(s) {sorted(unknown)}")
        if "pooling_type" in override:
            kind = str(override["pooling_type"]).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(f"--pooler-config: pooling_type must be one of {POOLING_TYPES}")
            values["pooling_type"] = kind
        if "normalize" in override:
            values["normalize"] = bool(override["normalize"])
        if "matryoshka_dimensions" in override:
            dims = override["matryoshka_dimensions"]
            if not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims):
                raise ValueError("--pooler-config: matryoshka_dimensions must be positive ints")
            values["matryoshka"] = True
            values["matryoshka_dimensions"] = tuple(dims)
    return PoolerConfig(**values)


def pooler_config_for(model: str, flag: str | None) -> PoolerConfig:
    """The pooling of the model spec ``model`` (alias, folder or GGUF; registry-resolved) under
    ``--pooler-config``; a spec that resolves to no folder gets the flag and the defaults."""
    from portico import registry

    try:
        folder: Path | None = registry.resolve(model).path
    except ValueError:
        folder = None
    return load_pooler_config(folder, flag)
