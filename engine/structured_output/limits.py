"""How big a constraint may be: cheap checks that run on the request path before any compile.

A grammar's compile and its matcher's per-token work grow with the constraint: a 1.5 MB schema
compiles for minutes, a regex with nested variable repeats (``(a+)+b``, ``(a{0,10}){0,100}``)
makes every bitmask fill slower than the one before, and ``(.{1000}){1000}`` builds a million
states. :func:`check_limits` refuses such inputs with a :class:`ConstraintLimitError` (a 400
naming the parameter and the limit) in time linear in the input's size, walking it once and
stopping at the first limit passed. What it cannot see (an ambiguous EBNF grammar, a compile
that is slow for another reason) is bounded by the compile budget of
:class:`~engine.structured_output.compile_pool.CompilePool`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import ParameterError, StructuredOutputsParams


@dataclass(frozen=True)
class ConstraintLimits:
    """The limits on one request's constraint (schema, regex, choice, grammar, tools).

    Defaults follow OpenAI's published structured-output limits where it has one (5000
    properties, 1000 enum values, 128 tools); the rest are well above what real schemas use
    and well below what stalls a compile.
    """

    max_bytes: int = 128 * 1024  # the constraint as compact JSON / the regex or grammar text
    max_depth: int = 32  # JSON nesting depth of the schema document
    max_properties: int = 5000  # object properties, summed over the whole schema
    max_enum_values: int = 1000  # enum + const values (and choice strings), summed
    max_nodes: int = 50_000  # JSON values in the schema document
    max_repeat: int = 10_000  # a repeat bound, and the product of nested repeat bounds
    max_tools: int = 128
    max_tools_bytes: int = 512 * 1024  # all tool definitions as compact JSON
    compile_timeout: float = 10.0  # seconds one compile may take (spec -> token automaton)
    compile_workers: int = 2  # worker processes that compile
    compile_per_tenant: int = 1  # of those, how many one tenant's compiles may hold at once
    # CPU milliseconds one sequence's next-token mask may take (an ambiguous grammar's grows
    # with every token); past it the sequence is cut with finish_reason "length".
    max_mask_ms: float = 50.0

    def __post_init__(self) -> None:
        for name in (
            "max_bytes", "max_depth", "max_properties", "max_enum_values", "max_nodes",
            "max_repeat", "max_tools", "max_tools_bytes", "compile_workers",
            "compile_per_tenant",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("compile_timeout", "max_mask_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")


# What each limit means, for ``--help`` (flag: ``--structured-outputs-`` + the field's name).
LIMIT_HELP = {
    "max_bytes": "largest schema, regex, grammar or choice list in bytes (compact JSON)",
    "max_depth": "deepest JSON nesting of a schema document",
    "max_properties": "most object properties in one schema (summed over all objects)",
    "max_enum_values": "most enum/const values in one schema, or choices",
    "max_nodes": "most JSON values in one schema document",
    "max_repeat": "largest regex repeat bound or string/array length bound, and largest "
    "product of nested repeat bounds",
    "max_tools": "most tool definitions in one request",
    "max_tools_bytes": "largest size of a request's tool definitions in bytes (compact JSON)",
    "compile_timeout": "seconds one grammar compile may take before it is cancelled (400)",
    "compile_workers": "grammar compile worker processes",
    "compile_per_tenant": "compiles one tenant may run at once (keep below the workers)",
    "max_mask_ms": "CPU milliseconds one sequence's next-token mask may take; past it the "
    "sequence ends with finish_reason length",
}


def limit_flag(name: str) -> str:
    """The engine flag of the limit ``name`` (a :class:`ConstraintLimits` field)."""
    return "--structured-outputs-" + name.replace("_", "-")


class ConstraintLimitError(ParameterError):
    """A constraint over one of :class:`ConstraintLimits`; the message names the limit."""

    def __init__(self, param: str, what: str, limit: int | float, name: str) -> None:
        super().__init__(
            param, f"{param}: {what}; the limit is {limit:g} (the server's {limit_flag(name)})"
        )
        self.limit = limit
        self.limit_name = name


def check_limits(spec: StructuredOutputsParams, limits: ConstraintLimits, param: str) -> None:
    """Raise :class:`ConstraintLimitError` if ``spec`` passes any limit (linear time)."""
    if spec.json is not None and not isinstance(spec.json, bool):
        _check_schema(spec.json, limits, param)
    elif spec.regex is not None:
        _check_text(spec.regex, limits, param)
        check_regex_limits(spec.regex, limits, param)
    elif spec.grammar is not None:
        _check_text(spec.grammar, limits, param)
    elif spec.choice is not None:
        if len(spec.choice) > limits.max_enum_values:
            raise ConstraintLimitError(
                param, f"{len(spec.choice)} choices", limits.max_enum_values,
                "max_enum_values",
            )  # fmt: skip
        _check_text("".join(spec.choice), limits, param)


def check_tools_limits(tools: Sequence[Any], limits: ConstraintLimits) -> None:
    """Raise :class:`ConstraintLimitError` for too many tools or too many bytes of them.

    ``tools`` are dicts or pydantic models (counted as their JSON without None fields)."""
    if len(tools) > limits.max_tools:
        raise ConstraintLimitError("tools", f"{len(tools)} tools", limits.max_tools, "max_tools")
    plain = [t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else t for t in tools]
    size = len(json.dumps(plain, separators=(",", ":"), default=str).encode())
    if size > limits.max_tools_bytes:
        raise ConstraintLimitError(
            "tools", f"the tool definitions are {size} bytes", limits.max_tools_bytes,
            "max_tools_bytes",
        )  # fmt: skip


# ----------------------------------------------------------------------------- schemas


def _check_text(text: str, limits: ConstraintLimits, param: str) -> None:
    size = len(text.encode())
    if size > limits.max_bytes:
        raise ConstraintLimitError(
            param, f"the constraint is {size} bytes", limits.max_bytes,
            "max_bytes",
        )  # fmt: skip


def _json_size(value: Any) -> int:
    """Bytes ``value`` adds to its document's compact JSON, not counting what it contains
    (escapes aside: a string counts its UTF-8 bytes and its quotes)."""
    if isinstance(value, str):
        return 2 + (len(value) if value.isascii() else len(value.encode()))
    if isinstance(value, dict):  # braces, and per member a key, its quotes, ":" and ","
        return 1 + sum(4 + (len(k) if k.isascii() else len(k.encode())) for k in value) or 2
    if isinstance(value, list):  # brackets and commas
        return 1 + len(value) if value else 2
    return len(str(value))  # numbers, true, false, null


# Schema keywords whose integer value becomes a repeat count in the grammar.
_BOUND_KEYWORDS = (
    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
)  # fmt: skip


def _check_schema(schema: Any, limits: ConstraintLimits, param: str) -> None:
    """One iterative walk over the document, stopping at the first limit passed: size, depth,
    nodes, properties, enum values, string and array bounds, every ``pattern`` regex. A
    1.5 MB schema is refused after its first 128 KiB are seen, in milliseconds."""
    num_nodes = num_properties = num_enum = num_bytes = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        num_nodes += 1
        num_bytes += _json_size(node)
        if num_bytes > limits.max_bytes:
            raise ConstraintLimitError(
                param, f"the schema is more than {limits.max_bytes} bytes of JSON",
                limits.max_bytes, "max_bytes",
            )  # fmt: skip
        if num_nodes > limits.max_nodes:
            raise ConstraintLimitError(
                param, f"the schema has more than {limits.max_nodes} JSON values",
                limits.max_nodes, "max_nodes",
            )  # fmt: skip
        if depth > limits.max_depth:
            raise ConstraintLimitError(
                param, f"the schema is nested deeper than {limits.max_depth} levels",
                limits.max_depth, "max_depth",
            )  # fmt: skip
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict):
            num_properties += len(props)
            if num_properties > limits.max_properties:
                raise ConstraintLimitError(
                    param, f"the schema has more than {limits.max_properties} properties",
                    limits.max_properties, "max_properties",
                )  # fmt: skip
        enum = node.get("enum")
        num_enum += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        if num_enum > limits.max_enum_values:
            raise ConstraintLimitError(
                param, f"the schema has more than {limits.max_enum_values} enum values",
                limits.max_enum_values, "max_enum_values",
            )  # fmt: skip
        for key in _BOUND_KEYWORDS:
            bound = node.get(key)
            if isinstance(bound, (int, float)) and bound > limits.max_repeat:
                raise ConstraintLimitError(
                    param, f"`{key}` {bound} is above the repeat limit", limits.max_repeat,
                    "max_repeat",
                )  # fmt: skip
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex_limits(pattern, limits, param)
        stack.extend((value, depth + 1) for value in node.values())


# ----------------------------------------------------------------------------- regexes


@dataclass
class _Part:
    """What the scanner knows about one atom, or one open group, of a regex."""

    weight: int = 1  # the largest product of repeat bounds inside
    has_variable: bool = False  # holds a repeat whose count varies (*, +, {m,n} with m < n)
    # Every way through it passes a character outside any varying repeat (a separator).
    has_fixed_char: bool = False
    branch_fixed: bool = False  # groups: the current alternative has such a character
    branches_fixed: bool = True  # groups: every earlier alternative had one


def check_regex_limits(pattern: str, limits: ConstraintLimits, param: str) -> None:
    """Refuse a repeat bound above ``max_repeat``, nested bounds whose product is above it,
    and a varying repeat of something that itself varies with no fixed character between the
    copies (``(a+)+``, ``(\\w+\\s?)*``, ``(a{0,9}){0,99}``): such a regex is ambiguous, and
    the matcher's work grows with every token it accepts. ``([a-z]+\\.)+`` is fine: the
    ``.`` separates the copies.

    A scanner, not a parser: it reads escapes, classes, groups, alternatives and quantifiers,
    which is all the limits need; the grammar library checks the syntax afterwards.
    """
    stack = [_Part()]
    pending: _Part | None = None  # the last atom: a quantifier may still apply to it
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c in "*+?{":
            bounds, end = _quantifier(pattern, i)
            if bounds is not None:
                if pending is not None:
                    pending = _repeat(pending, bounds, limits, param)
                i = end + (end < n and pattern[end] in "?+")  # lazy or possessive
                continue
        if pending is not None:
            _add(stack[-1], pending)
            pending = None
        if c == "\\":
            pending, i = _Part(has_fixed_char=True), i + 2
        elif c == "[":
            pending, i = _Part(has_fixed_char=True), _class_end(pattern, i)
        elif c == "(":
            stack.append(_Part())
            i += 1
            if pattern.startswith("?", i):  # (?:...), (?<name>...), (?i)...: skip the marker
                close = pattern.find(">", i) if pattern.startswith("?<", i) else -1
                i = close + 1 if close > 0 else i + 2
        elif c == ")":
            if len(stack) > 1:
                pending = _close(stack.pop())
            i += 1
        elif c == "|":
            group = stack[-1]
            group.branches_fixed &= group.branch_fixed
            group.branch_fixed = False
            i += 1
        else:
            pending, i = _Part(has_fixed_char=c not in "^$"), i + 1


def _add(group: _Part, atom: _Part) -> None:
    group.weight = max(group.weight, atom.weight)
    group.has_variable |= atom.has_variable
    group.branch_fixed |= atom.has_fixed_char


def _close(group: _Part) -> _Part:
    fixed = group.branches_fixed and group.branch_fixed
    return _Part(group.weight, group.has_variable, fixed)


def _repeat(
    atom: _Part, bounds: tuple[int, int | None], limits: ConstraintLimits, param: str
) -> _Part:
    """``atom`` under the quantifier ``{lo,hi}`` (hi None: unbounded), or a refusal."""
    lo, hi = bounds
    top = max(lo, hi or 0)
    if top > limits.max_repeat:
        raise ConstraintLimitError(
            param, f"the regex repeats {top} times", limits.max_repeat,
            "max_repeat",
        )  # fmt: skip
    varies = hi is None or hi > lo
    if varies and (hi is None or hi > 1) and atom.has_variable and not atom.has_fixed_char:
        raise ConstraintLimitError(
            param,
            "the regex repeats a part that itself repeats a varying number of times (nested "
            "quantifiers such as (a+)+ make the matcher's work grow with every token); put a "
            "fixed character between the copies or bound the outer repeat to one",
            limits.max_repeat, "max_repeat",
        )  # fmt: skip
    weight = atom.weight * max(top, 1)
    if weight > limits.max_repeat:
        raise ConstraintLimitError(
            param, f"nested repeats multiply to {weight}", limits.max_repeat,
            "max_repeat",
        )  # fmt: skip
    # A varying repeat's characters are not separators: the copies can shift across them.
    return _Part(weight, atom.has_variable or varies, atom.has_fixed_char and not varies and lo > 0)


def _class_end(pattern: str, start: int) -> int:
    """The index after the ``]`` closing the class opened at ``start``."""
    i = start + 1
    if pattern.startswith("^", i):
        i += 1
    if pattern.startswith("]", i):
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _quantifier(pattern: str, i: int) -> tuple[tuple[int, int | None] | None, int]:
    """The bounds of the quantifier at ``i`` and the index after it; None for a ``{`` that
    is a literal."""
    c = pattern[i]
    if c == "*":
        return (0, None), i + 1
    if c == "+":
        return (1, None), i + 1
    if c == "?":
        return (0, 1), i + 1
    close = pattern.find("}", i)
    body = pattern[i + 1 : close] if close > 0 else ""
    lo_text, comma, hi_text = body.partition(",")
    if not lo_text.strip().isdigit() or (hi_text.strip() and not hi_text.strip().isdigit()):
        return None, i + 1
    lo = int(lo_text)
    hi = None if comma and not hi_text.strip() else int(hi_text) if comma else lo
    return (lo, hi), close + 1
