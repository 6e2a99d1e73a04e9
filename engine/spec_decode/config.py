"""``--speculative-config``: vLLM's JSON keys, validated once at startup."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
}
# Measured (docs/benchmarks.md, load/spec_bench.py): above this many running requests a step
# is compute-bound enough that verifying guesses costs more than the accepted tokens save.
DEFAULT_DISABLE_BY_BATCH_SIZE = 2
FLAG = "--speculative-config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: which proposer, how many guesses, and when it stops.

    ``method`` is ``ngram`` (prompt lookup: the longest suffix of ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens that occurred earlier proposes what followed it) or
    ``draft_model`` (``model``, any model Portico loads that shares the target's tokenizer,
    proposes greedily). ``disable_by_batch_size``: with more running requests than this, no
    request speculates (None: never off).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"{FLAG}: method must be one of {', '.join(METHODS)}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{FLAG}: prompt_lookup_min must be <= prompt_lookup_max")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.method == "draft_model" and not self.model:
            raise ValueError(f'{FLAG}: method "draft_model" needs "model"')
        if self.method == "ngram" and self.model not in (None, "[ngram]"):
            raise ValueError(f'{FLAG}: method "ngram" takes no "model"')

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the flag's JSON text (or its dict). ValueError naming the flag and key."""
        if isinstance(value, SpeculativeConfig):
            return value
        obj: Any = value
        if isinstance(value, str):
            try:
                obj = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{FLAG} must be a JSON object: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{FLAG} must be a JSON object, got {value!r}")
        unknown = sorted(set(obj) - _KEYS)
        if unknown:
            raise ValueError(f"{FLAG}: unknown key(s) {', '.join(unknown)}")
        if "num_speculative_tokens" not in obj:
            raise ValueError(f"{FLAG} needs num_speculative_tokens")
        fields = dict(obj)
        method = fields.pop("method", None)
        model = fields.get("model")
        if method is None:  # vLLM: "[ngram]" as the model, else the model is a draft
            method = "ngram" if model in (None, "[ngram]") else "draft_model"
        if method == "ngram":  # vLLM's rule: a missing bound is the other one; neither: 5
            fields.pop("model", None)
            lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
            fields["prompt_lookup_min"] = lo if lo is not None else hi if hi is not None else 5
            fields["prompt_lookup_max"] = hi if hi is not None else fields["prompt_lookup_min"]
        if "disable_by_batch_size" not in fields:
            fields["disable_by_batch_size"] = DEFAULT_DISABLE_BY_BATCH_SIZE
        return cls(method=method, **fields)

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "disable_by_batch_size": self.disable_by_batch_size,
        }
        if self.method == "ngram":
            data["prompt_lookup_min"] = self.prompt_lookup_min
            data["prompt_lookup_max"] = self.prompt_lookup_max
        else:
            data["model"] = self.model
        return json.dumps(data)


def _check_int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{FLAG}: {key} must be an integer >= {minimum}, got {value!r}")
