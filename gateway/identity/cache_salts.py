"""The ``cache_salt`` a local engine receives, derived from who is calling.

The engine hashes the salt into a request's first KV block, so two requests share cached
prefix blocks only when their salts are equal. The gateway alone decides the salt: the tenant's
(:meth:`gateway.identity.tenants.TenantStore.tenant_salt`, an HMAC of the tenant id under the
server secret, or ``shared:<plan>`` for a plan that shares its cache). A client may send its own
``cache_salt`` to split its tenant's cache further (per end user, say); that salt only narrows:
the engine gets the tenant's salt joined with a hash of the client's, never the client's text
alone, so no client salt can reach another tenant's blocks.

A plan may declare shared prefixes (a company-wide system prompt): a request that starts with
one tells the local engine so, in the header ``x-portico-cache-shared-prefix:
<characters>;<salt>`` the gateway builds like its other engine-hop headers. The engine hashes
that prefix's full blocks under the plan's salt and the rest of the request under the
tenant's, so the plan's tenants share exactly the declared text.
"""

from __future__ import annotations

import hashlib

NARROWED_SEPARATOR = "/"  # never in a tenant salt (hex, or "shared:" + a plan name)


def shared_prefix_salt(plan: str) -> str:
    """The salt of a plan's shared prefixes (``shared_prefixes`` in the plans file): every
    tenant of the plan holds it, and no tenant's own salt can equal it (those are hex
    digests, or ``shared:<plan>``)."""
    return f"shared-prefix:{plan}"


def narrowed_salt(tenant_salt: str, client_salt: str | None) -> str:
    """The salt for a request of the tenant whose salt is ``tenant_salt``, narrowed by the
    client's own ``client_salt`` when it sent one. Equal inputs give equal salts (a client
    that reuses its salt hits its own cache); the result is at most ~100 characters whatever
    the client sent."""
    if client_salt is None:
        return tenant_salt
    digest = hashlib.sha256(
        tenant_salt.encode() + b"\x00" + client_salt.encode("utf-8", "surrogatepass")
    ).hexdigest()[:32]
    return tenant_salt + NARROWED_SEPARATOR + digest
