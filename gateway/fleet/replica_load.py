"""What a replica is busy with, as this gateway sent it, and what a new request would wait there.

:class:`ReplicaLoad` is live, exact accounting of this gateway's requests on one replica: each
holds a :class:`Lease` from the moment it is sent until its answer is closed, charged with the
prompt tokens the replica must compute for it (its prompt less the prefix the index says is
cached there) until its first output token arrives, then counted as one decode row. Per tenant,
the prefill still pending is kept too: that is where the engine's fair scheduler
(engine/scheduling_policy.py) puts a tenant's next request.

:func:`estimate_wait` turns a replica's load into the work, in token-equivalents, that runs on
it before a new request's first token, following what the engine's default ``fair`` policy
does with it (processor sharing between tenants, least served first):

- the request needs ``need`` prefill tokens of its tenant there before its first token: the
  tenant's own prefill pending there (FCFS within a tenant) plus its uncached prompt;
- each other tenant with prefill pending there shares those steps with it, so ahead of its
  first token come at most ``need`` tokens of each: ``sum(min(pending_t, need))`` (requests
  without a tenant are one flow, like a tenant);
- except the short step: a tenant with nothing pending there whose uncached prompt is at most
  ``SHORT_PREFILL_TOKENS`` (the engine's ``--fair-short-prefill-tokens``) runs in a step of its
  own, beside the decodes only: no other tenant's prefill is ahead of it;
- requests queued there by others (other gateways) count as ahead: their tenants are unknown;
- every step while it waits carries the replica's decode rows and a fixed cost
  (``STEP_OVERHEAD_TOKENS``), and a step holds at most one chunk of prefill
  (``PREFILL_CHUNK_TOKENS``, the engine's ``--fair-contended-prefill-tokens``).

The rule is the same for the holder of a tenant's prompt and for a replica it would spill to.
(The rule before charged a tenant with its own prefill pending all the other tenants' pending
prefill, and one without at most one chunk of it however long its own prompt: a new tenant's
cold prompt saw two tenants pending as one, and a tenant's next question on its holder was
weighed against a spill that looked ~600 tokens cheaper than it is. The fleet bench's opening
burst worked through: tests/gateway/dataplane/test_replica_load.py.)

A request whose uncached prompt blocks another request sent to the same replica is computing
now (a tenant's second question, sent while its first is still prefilling its system prompt)
``follows`` that request: the proxy holds it until the leader's first token, so the engine finds
the blocks cached instead of computing them a second time side by side (it does not wait for
blocks another request is computing; each computes its own).

So the holder of a tenant's prompt keeps it while other tenants' short work runs there, and
loses it when the tenant's own requests pile up there or it has more tenants' long prefills
than the other replica by more than the recomputation; the pool adds the recomputation itself
once more as the cost a spill puts on the fleet (gateway/fleet/pool.py). Event loop thread
only.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field

from portico.contract import FAIR_CONTENDED_PREFILL_TOKENS, FAIR_SHORT_PREFILL_TOKENS

# The engine's default --fair-contended-prefill-tokens: the most prefill one step carries while
# two or more tenants have work (the contract's number, portico/contract.py).
PREFILL_CHUNK_TOKENS = FAIR_CONTENDED_PREFILL_TOKENS
# The engine's default --fair-short-prefill-tokens: a tenant with nothing waiting whose prompt
# needs at most this many tokens gets a step of its own, the others' prefill sitting it out
# (engine/scheduling_policy.py, FairPolicy.short_step).
SHORT_PREFILL_TOKENS = FAIR_SHORT_PREFILL_TOKENS
# A step's fixed cost (Python, kernel launches, sampling) in prompt-token equivalents: ~8 ms
# against ~0.8 ms per token on a 2-core CPU with a 135M model (docs/benchmarks.md, issue 29).
STEP_OVERHEAD_TOKENS = 10
# A request's adapter not in one of the replica's LoRA slots: it is copied in (or read from its
# folder) before the step runs, about a short prefill's worth of time.
ADAPTER_LOAD_TOKENS = 64


@dataclass(slots=True)
class ReplicaLoad:
    """This gateway's requests on one replica: how many are open (``outstanding``), prompt
    tokens still to compute (in total and per tenant, None for requests without one) and how
    many are past their first token (decode rows). A lease gives back exactly what it took."""

    outstanding: int = 0
    pending_prefill: int = 0
    num_prefilling: int = 0
    num_decoding: int = 0
    tenant_prefill: dict[str | None, int] = field(default_factory=dict)
    # prompt blocks being computed here now: block hash -> the lease of the request computing
    # it (until its first token)
    computing: dict[bytes, Lease] = field(default_factory=dict)

    def lease(
        self,
        prefill_tokens: int,
        tenant: str | None,
        blocks: tuple[bytes, ...] = (),
        follows: Lease | None = None,
    ) -> Lease:
        """A request just sent here, with ``prefill_tokens`` prompt tokens to compute, of which
        ``blocks`` (hashes) no other request here is computing; ``follows``: the request
        computing the deepest of its other uncached blocks."""
        self.outstanding += 1
        self.pending_prefill += prefill_tokens
        self.num_prefilling += 1
        self.tenant_prefill[tenant] = self.tenant_prefill.get(tenant, 0) + prefill_tokens
        lease = Lease(self, prefill_tokens, tenant, blocks, follows)
        for block_hash in blocks:
            self.computing[block_hash] = lease
        return lease


@dataclass(slots=True, eq=False)
class Lease:
    """One request's charge on a :class:`ReplicaLoad`. :meth:`first_token` moves it from the
    pending prefill to the decode rows; :meth:`release` takes it off. Both are idempotent, and
    a release before the first token takes back the prefill."""

    load: ReplicaLoad
    prefill_tokens: int
    tenant: str | None
    blocks: tuple[bytes, ...] = ()
    follows: Lease | None = None
    streamed: bool = False  # its first token is seen (a stream): followers may wait for it
    prefilled: bool = False
    released: bool = False
    _done: asyncio.Event | None = None

    async def wait_prefilled(self, timeout_s: float) -> None:
        """Until this request's first token (or its end), at most ``timeout_s``."""
        if self.prefilled or self.released:
            return
        if self._done is None:
            self._done = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._done.wait(), timeout_s)

    def _end_prefill(self) -> None:
        load = self.load
        for block_hash in self.blocks:
            if load.computing.get(block_hash) is self:
                del load.computing[block_hash]
        if self._done is not None:
            self._done.set()
        load.pending_prefill -= self.prefill_tokens
        load.num_prefilling -= 1
        left = load.tenant_prefill.get(self.tenant, 0) - self.prefill_tokens
        if left > 0:
            load.tenant_prefill[self.tenant] = left
        else:
            load.tenant_prefill.pop(self.tenant, None)
        self.prefilled = True

    def first_token(self) -> None:
        if self.prefilled or self.released:
            return
        self._end_prefill()
        self.load.num_decoding += 1

    def release(self) -> None:
        if self.released:
            return
        if self.prefilled:
            self.load.num_decoding -= 1
        else:
            self._end_prefill()
        self.load.outstanding -= 1
        self.released = True


def estimate_wait(
    load: ReplicaLoad,
    tenant: str | None,
    uncached_tokens: int,
    *,
    foreign_prefill: float = 0.0,
    num_decoding: int | None = None,
) -> float:
    """Token-equivalents of work on the replica before this request's first token (see the
    module docstring). ``foreign_prefill``: prompt tokens queued there by others (other
    gateways, as the engine reports them); ``num_decoding``: the replica's decode rows when
    the engine reports more than ours. Whose they are is unknown, so they count as ahead."""
    own = load.tenant_prefill.get(tenant, 0)
    need = own + uncached_tokens
    if not own and uncached_tokens <= SHORT_PREFILL_TOKENS:
        ahead = 0  # a short step of its own
    else:
        ahead = sum(min(p, need) for t, p in load.tenant_prefill.items() if t != tenant)
    prefill = ahead + need + foreign_prefill
    steps = max(1, math.ceil(prefill / PREFILL_CHUNK_TOKENS))
    rows = load.num_decoding if num_decoding is None else max(num_decoding, load.num_decoding)
    return prefill + steps * (STEP_OVERHEAD_TOKENS + rows)
