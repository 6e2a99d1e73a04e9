"""A request's shared prefix, as the gateway declares it on the engine hop.

A plan may list prompt prefixes its tenants share in the prefix cache (a company's system
prompt). The gateway, which alone knows plans, tells the engine that a request starts with one
in the header ``x-portico-cache-shared-prefix: <characters>;<salt>``: the first ``characters``
characters of the first message's text (chat) or of the prompt (completions) are the shared
prefix, to be cached under ``salt``. Only the gateway sets it (it builds engine-hop headers
itself; a client's ``x-portico-*`` headers never travel).

The engine turns the characters into tokens itself, on the exact prompt it will run: the shared
tokens are the longest common start of the prompt's token ids and those of the prefix rendered
alone (the chat template's header included). Only tokens of the declared text can be in it, so
only they are ever hashed under the shared salt (:func:`engine.kv_cache_manager.
with_shared_prefix`); the rest of the request stays under its own salt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.kv_cache_manager import with_shared_prefix
from portico.errors import InvalidRequestError

SHARED_PREFIX_HEADER = "x-portico-cache-shared-prefix"
MAX_SALT_CHARS = 1024


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """``num_chars`` leading characters of the request's text, cached under ``salt``."""

    num_chars: int
    salt: str


def shared_prefix_of(headers: Mapping[str, str]) -> SharedPrefix | None:
    """The declared shared prefix, None without the header; a 400 naming it when malformed
    (only the gateway sets it: a bad one is a bug to be loud about)."""
    value = headers.get(SHARED_PREFIX_HEADER)
    if value is None:
        return None
    count, sep, salt = value.partition(";")
    if not sep or not count.isdigit() or int(count) < 1 or not 1 <= len(salt) <= MAX_SALT_CHARS:
        raise InvalidRequestError(
            f"{SHARED_PREFIX_HEADER} must be '<characters>;<salt>' (a positive count, a salt "
            f"of 1 to {MAX_SALT_CHARS} characters).",
            param=SHARED_PREFIX_HEADER,
        )
    return SharedPrefix(int(count), salt)


def common_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def salt_with_prefix(
    cache_salt: str | None,
    shared: SharedPrefix,
    prompt_ids: Sequence[int],
    prefix_ids: Sequence[int],
) -> str:
    """The request's cache salt with its shared prefix: the tokens it has in common with the
    prefix rendered alone are hashed under the shared salt."""
    return with_shared_prefix(cache_salt, shared.salt, common_start(prompt_ids, prefix_ids))
