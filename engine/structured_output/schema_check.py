"""Which JSON-schema keywords the grammar enforces, and a walk that names any other.

xgrammar turns a schema into a grammar and *ignores* (with a log line) keywords it cannot
express, so a schema using ``not`` or ``uniqueItems`` would be accepted and then not held.
That breaks the promise "the output validates against the schema", so such a schema is
refused up front with the keyword and where it is (a 400 at the server). Annotations
(``title``, ``description``, ``examples``...) constrain nothing and are always fine.
"""

from __future__ import annotations

import re
from typing import Any

# Constraining keywords xgrammar does not hold (it ignores them, or holds only part).
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
        "contains", "minContains", "maxContains", "uniqueItems", "multipleOf",
        "patternProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
        "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip

# ``format`` values the grammar holds; any other format would be silently free text.
SUPPORTED_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname",
        "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip

# Regex constructs the grammar's regex engine drops: lookaround and backreferences.
_UNSUPPORTED_REGEX = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")

_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")


class UnsupportedSchema(ValueError):
    """A schema keyword the grammar cannot hold; the message names it and its location."""


def check_schema(schema: Any, where: str = "#") -> None:
    """Raise :class:`UnsupportedSchema` for the first keyword the grammar would not hold."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"the schema at {where} must be an object or a boolean")
    for key in schema:
        if key in UNSUPPORTED_KEYWORDS:
            raise UnsupportedSchema(f"unsupported JSON schema feature `{key}` at {where}")
    fmt = schema.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        raise UnsupportedSchema(f"unsupported JSON schema format `{fmt}` at {where}/format")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _UNSUPPORTED_REGEX.search(pattern):
        raise UnsupportedSchema(
            f"unsupported regex feature (lookaround or backreference) in `pattern` at {where}"
        )
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise UnsupportedSchema(f"unsupported remote `$ref` {ref!r} at {where} (only #/...)")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise UnsupportedSchema(
            f"unsupported JSON schema feature `allOf` with several parts at {where}"
        )
    for key in _SCHEMA_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                check_schema(sub, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{where}/{key}/{i}")
    for key in _SCHEMA_VALUES:
        sub = schema.get(key)
        if isinstance(sub, list):  # draft-4 tuple form of items
            for i, item in enumerate(sub):
                check_schema(item, f"{where}/{key}/{i}")
        elif sub is not None:
            check_schema(sub, f"{where}/{key}")


def check_regex(pattern: str) -> None:
    """Raise :class:`UnsupportedSchema` for regex constructs the grammar would drop."""
    if _UNSUPPORTED_REGEX.search(pattern):
        raise UnsupportedSchema("unsupported regex feature (lookaround or backreference)")
