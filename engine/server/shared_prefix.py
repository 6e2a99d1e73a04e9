"""A request's shared prefix, as the gateway declares it on the engine hop.

A plan may list prompt prefixes its tenants share in the prefix cache (a company's system
prompt). The gateway, which alone knows plans, tells the engine that a request starts with one
in the header ``x-portico-cache-shared-prefix: <characters>;<salt>`` (the header and its
parsing are the contract's: :func:`portico.contract.shared_prefix_of`): the first ``characters``
characters of the first message's text (chat) or of the prompt (completions) are the shared
prefix, to be cached under ``salt``. Only the gateway sets it (it builds engine-hop headers
itself; a client's ``x-portico-*`` headers never travel).

The engine turns the characters into tokens itself, on the exact prompt it will run: the shared
tokens are the longest common start of the prompt's token ids and those of the prefix rendered
alone (the chat template's header included). Only tokens of the declared text can be in it, so
only they are ever hashed under the shared salt (:func:`portico.contract.
with_shared_prefix`); the rest of the request stays under its own salt.
"""

from __future__ import annotations

from collections.abc import Sequence

from portico.contract import SharedPrefix, with_shared_prefix


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
