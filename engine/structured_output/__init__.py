"""Constrained decoding: grammars that hold a request's output to a JSON schema, a regex, a
choice or an EBNF grammar. See :class:`StructuredOutputManager`."""

from engine.structured_output.manager import GrammarState, StructuredOutputManager

__all__ = ["GrammarState", "StructuredOutputManager"]
