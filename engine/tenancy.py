"""Who a request belongs to, as the gateway says on the engine hop: the scheduler's tenant tag.

The headers, their bounds and their parsing are the gateway-engine contract
(:mod:`portico.contract`); the engine's modules take the tag from here.
"""

from __future__ import annotations

from portico.contract import DEFAULT_TENANT, TenantTag, tenant_from_headers

__all__ = ["DEFAULT_TENANT", "TenantTag", "tenant_from_headers"]
