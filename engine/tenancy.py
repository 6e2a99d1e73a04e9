"""Who a request belongs to, as the gateway says on the engine hop: the scheduler's tenant tag.

The gateway sets these headers on every request it sends to a local engine (it builds them
itself from the authenticated principal and its plan; a client's own ``x-portico-*`` headers
never reach the engine):

- ``x-portico-tenant``: the tenant id (at most 200 characters)
- ``x-portico-tenant-weight``: the plan's weight, a positive number (default 1.0)
- ``x-portico-priority-class``: ``interactive`` or ``batch`` (default ``interactive``)
- ``x-portico-kv-share``: the most of the KV cache the tenant may hold, in (0, 1] (default 1.0)
- ``x-portico-max-running``: the most sequences the tenant may run at once on this engine, a
  whole number >= 0 (default 0: no cap of its own; the fair policy still takes slots back from
  a tenant over its share while others wait, see docs/internals.md "Slot share")

A request without them belongs to the tenant ``default`` with the defaults above.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.sampling_params import ParameterError

TENANT_HEADER = "x-portico-tenant"
WEIGHT_HEADER = "x-portico-tenant-weight"
PRIORITY_CLASS_HEADER = "x-portico-priority-class"
KV_SHARE_HEADER = "x-portico-kv-share"
MAX_RUNNING_HEADER = "x-portico-max-running"

PRIORITY_CLASSES = ("interactive", "batch")  # served in this order
MAX_TENANT_LEN = 200
MAX_WEIGHT = 1e6  # a weight beyond this is a typo, and it would make the counters meaningless
MAX_RUNNING = 1_000_000  # a cap beyond any engine's --max-num-seqs is a typo


@dataclass(frozen=True, slots=True)
class TenantTag:
    """A request's tenant as the scheduler sees it: name, plan weight, class, KV share and cap.

    ``weight`` > 0 scales the tenant's fair share (2.0 gets twice the tokens of 1.0 when
    both are backlogged); ``priority_class`` is ``interactive`` (served first) or ``batch``;
    ``kv_share`` in (0, 1] caps the fraction of KV blocks the tenant's requests may hold;
    ``max_running`` > 0 caps how many of its requests run at once (0: no cap of its own).
    Values are validated by :func:`tenant_from_headers`; constructing one directly trusts them.
    """

    name: str = "default"
    weight: float = 1.0
    priority_class: str = "interactive"
    kv_share: float = 1.0
    max_running: int = 0

    @property
    def class_rank(self) -> int:
        """0 for interactive, 1 for batch: lower is served first."""
        return 1 if self.priority_class == "batch" else 0


DEFAULT_TENANT = TenantTag()


def tenant_from_headers(headers: Mapping[str, str]) -> TenantTag:
    """The tenant tag the engine-hop headers describe; ParameterError (a 400) on a bad value.

    ``headers`` must look names up case-insensitively if the caller's names may vary in
    case (Starlette's ``Headers`` does); absent headers take the defaults.
    """
    name = headers.get(TENANT_HEADER)
    if name is None:
        name = DEFAULT_TENANT.name
    elif not name or len(name) > MAX_TENANT_LEN or not name.isprintable():
        raise ParameterError(
            TENANT_HEADER,
            f"{TENANT_HEADER} must be 1 to {MAX_TENANT_LEN} printable characters",
        )
    weight = _number(headers, WEIGHT_HEADER, DEFAULT_TENANT.weight)
    if not 0 < weight <= MAX_WEIGHT:
        raise ParameterError(
            WEIGHT_HEADER, f"{WEIGHT_HEADER} must be a number in (0, {MAX_WEIGHT:g}], got {weight}"
        )
    kv_share = _number(headers, KV_SHARE_HEADER, DEFAULT_TENANT.kv_share)
    if not 0 < kv_share <= 1:
        raise ParameterError(
            KV_SHARE_HEADER, f"{KV_SHARE_HEADER} must be a number in (0, 1], got {kv_share}"
        )
    priority_class = headers.get(PRIORITY_CLASS_HEADER, DEFAULT_TENANT.priority_class).strip()
    if priority_class not in PRIORITY_CLASSES:
        raise ParameterError(
            PRIORITY_CLASS_HEADER,
            f"{PRIORITY_CLASS_HEADER} must be one of {', '.join(PRIORITY_CLASSES)}, "
            f"got {priority_class!r}",
        )
    max_running = _whole_number(headers, MAX_RUNNING_HEADER)
    tag = TenantTag(name, weight, priority_class, kv_share, max_running)
    return DEFAULT_TENANT if tag == DEFAULT_TENANT else tag


def _whole_number(headers: Mapping[str, str], header: str) -> int:
    text = headers.get(header)
    if text is None:
        return 0
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_RUNNING:
        raise ParameterError(
            header, f"{header} must be a whole number in [0, {MAX_RUNNING}], got {text!r}"
        )
    return int(text)


def _number(headers: Mapping[str, str], header: str, default: float) -> float:
    text = headers.get(header)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ParameterError(header, f"{header} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ParameterError(header, f"{header} must be a finite number, got {text!r}")
    return value
