"""The engine hop's tenant headers: whose request a local engine is serving.

Every request the gateway sends to a local engine names the authenticated caller's tenant and
its plan's scheduling share (weight, priority class, KV share, running cap) in five
``x-portico-*`` headers;
the engine's scheduler reads them. The names and their parsing are the contract's
(portico/contract.py). The gateway builds an upstream request's
headers from scratch (:meth:`gateway.relay.proxy.LocalUpstream.request_headers`), so a
client's own ``x-portico-*`` headers never reach an engine, and remote providers, whose headers
are their own, never receive these.
"""

from __future__ import annotations

from gateway.identity.principal import Principal
from portico.contract import (
    ENGINE_HOP_HEADERS,
    KV_SHARE_HEADER,
    MAX_RUNNING_HEADER,
    PRIORITY_CLASS_HEADER,
    TENANT_HEADER,
    WEIGHT_HEADER,
)

__all__ = ["ENGINE_HOP_HEADERS", "PRIORITY_CLASS_HEADER", "engine_hop_headers"]


def engine_hop_headers(principal: Principal) -> dict[str, str]:
    """The five headers for ``principal``: its tenant id, and its plan's weight, priority
    class, KV share (numbers as Python writes floats, which the engine parses back) and
    running cap (a whole number; 0: none of its own)."""
    share = principal.share
    return {
        TENANT_HEADER: principal.tenant_id,
        WEIGHT_HEADER: repr(float(share.weight)),
        PRIORITY_CLASS_HEADER: share.priority_class,
        KV_SHARE_HEADER: repr(float(share.kv_share)),
        MAX_RUNNING_HEADER: str(int(share.max_running)),
    }
