"""Slot share: how many running slots (``--max-num-seqs``) each active tenant is owed.

The fair policy's rule (engine/scheduling_policy.py, ``FairPolicy.reclaim_victim``; the why in
docs/internals.md, "Slot share"): while tenants contend, a tenant is owed ``max(1,
floor(max_num_seqs x weight / sum of the active tenants' weights))`` slots, at most its plan's
``max_running``. The floor keeps the shares' sum within the slots (but for the ``max(1, ...)``
when tenants outnumber slots), so every tenant can hold its share at the same time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from engine.request import Request
from engine.tenancy import TenantTag


def slot_shares(tenants: Iterable[TenantTag], max_num_seqs: int) -> dict[str, int]:
    """The slots each of ``tenants`` (the active ones, one tag per name) is owed."""
    tags = list(tenants)
    total = sum(tag.weight for tag in tags)
    shares = {}
    for tag in tags:
        share = max(1, math.floor(max_num_seqs * tag.weight / total + 1e-9))
        shares[tag.name] = min(share, tag.max_running) if tag.max_running else share
    return shares


def count_by_tenant(running: Sequence[Request]) -> dict[str, int]:
    """Running requests per tenant name."""
    held: dict[str, int] = {}
    for r in running:
        held[r.tenant.name] = held.get(r.tenant.name, 0) + 1
    return held
