"""Constrained decoding: grammars that hold a request's output to a JSON schema, a regex, a
choice or an EBNF grammar. See :class:`StructuredOutputManager`.

The manager (xgrammar, torch) is imported on first use, so that the engine's flags
(``engine.config``) can read :mod:`engine.structured_output.limits` without loading them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.structured_output.manager import GrammarState, StructuredOutputManager

__all__ = ["GrammarState", "StructuredOutputManager"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from engine.structured_output import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
