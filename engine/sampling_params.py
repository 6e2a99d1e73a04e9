"""Sampling parameters of one request, validated once at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from portico.errors import ParameterError as ParameterError  # its home; engine code imports it here

if TYPE_CHECKING:
    from engine.pooling_params import PoolingParams

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParameterError(name, f"{name} must be a number, got {type(value).__name__}")
    if math.isnan(value) or math.isinf(value):
        raise ParameterError(name, f"{name} must be a finite number, got {value}")
    return float(value)


def _check_int(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value):
        raise ParameterError(name, f"{name} must be an integer, got {type(value).__name__}")


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ParameterError(name, f"{name} must be in [{low}, {high}], got {value}")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match: exactly one of the constraints below.

    vLLM's ``structured_outputs`` shape, so its clients' payloads map one to one. ``json`` is a
    JSON schema (a dict, or a string holding one); ``json_object`` asks for any JSON object;
    ``regex`` a regular expression the whole output matches; ``choice`` one of the strings;
    ``grammar`` an EBNF (GBNF) grammar whose root rule is ``root``. ``disable_any_whitespace``
    forbids whitespace between JSON tokens (compact output). ``whitespace_pattern`` is
    accepted for vLLM compatibility (``guided_whitespace_pattern``) and not used: xgrammar has
    no such knob (vLLM's xgrammar backend ignores it too). The constraint is checked for shape here;
    whether the grammar library supports it is decided when it compiles (a 400 naming the
    feature).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ParameterError(
                "structured_outputs",
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}",
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ParameterError(
                    "structured_outputs.json", f"the JSON schema is not valid JSON: {exc}"
                ) from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ParameterError("structured_outputs.json", "the JSON schema must be an object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParameterError(
                    f"structured_outputs.{name}", f"{name} must be a non-empty string"
                )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ParameterError(
                "structured_outputs.choice", "choice must be a non-empty list of strings"
            )
        if self.choice is not None:
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(f"structured_outputs.{name}", f"{name} must be a boolean")

    @property
    def kind(self) -> str:
        """The constraint set: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        if self.json is not None:
            return "json"
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        return "grammar"

    @property
    def cache_key(self) -> str:
        """The constraint as canonical text: equal constraints share one compiled grammar."""
        spec: Any
        if self.json is not None:
            spec = json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        elif self.choice is not None:
            spec = json.dumps(self.choice)
        else:
            spec = self.regex or self.grammar or ""
        return f"{self.kind}|ws={int(self.disable_any_whitespace)}|{spec}"


@dataclass
class SamplingParams:
    """How to sample one request's completion.

    Every field is checked in ``__post_init__``; a bad value raises :class:`ParameterError`
    (a ``ValueError``) whose message starts with the parameter's name. After construction the
    engine trusts the object and never re-checks it. ``stop`` may be given as one string; it is
    stored as a list.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token (0 = only the chosen token)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The grammar the output must match (JSON schema, regex, choice, EBNF); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # An embedding request (engine/pooling.py): the prompt's hidden states pooled; the one
    # token it samples is discarded.
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ParameterError("n", f"n must be at least 1, got {self.n}")
        _check_int("max_tokens", self.max_tokens, optional=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParameterError(
                "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"
            )
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ParameterError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ParameterError("temperature", f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ParameterError("top_k", f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        self.min_p = _check_float("min_p", self.min_p)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            _check_range(name, value, -2.0, 2.0)
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ParameterError(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        _check_int("seed", self.seed, optional=True)
        self.stop = self._checked_stop(self.stop)
        self.stop_token_ids = self._checked_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(name, f"{name} must be a boolean")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check_int(name, value, optional=True)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ParameterError(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        self.logit_bias = self._checked_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ParameterError(
                "structured_outputs", "structured_outputs must be a StructuredOutputsParams"
            )

    @staticmethod
    def _checked_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ParameterError("stop", "stop must be a string or a list of strings")
        if any(s == "" for s in stop):
            raise ParameterError("stop", "stop must not contain empty strings")
        return list(stop)

    @staticmethod
    def _checked_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ParameterError(
                "stop_token_ids", "stop_token_ids must be a list of non-negative integers"
            )
        return list(ids)

    @staticmethod
    def _checked_logit_bias(bias: Any) -> dict[int, float]:
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise ParameterError("logit_bias", "logit_bias must map token ids to numbers")
        checked: dict[int, float] = {}
        for key, value in bias.items():
            # JSON object keys are strings: OpenAI clients send {"50256": -100}.
            token = int(key) if isinstance(key, str) and key.isdigit() else key
            if not _is_int(token) or token < 0:
                raise ParameterError("logit_bias", f"logit_bias key {key!r} is not a token id")
            number = _check_float("logit_bias", value)
            _check_range("logit_bias", number, -100.0, 100.0)
            checked[token] = number
        return checked

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
