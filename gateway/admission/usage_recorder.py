"""Per-request usage counted in memory and written to Redis in batches.

Writing each request's usage on its own costs a pipelined round trip of seven commands per
request; summing in memory and flushing every ``interval_s`` costs one round trip per interval
for all requests, with the same keys and fields (``UsageLedger.add_usage``). The admin usage
API therefore lags by at most ``interval_s``. ``aclose`` flushes what is left (the gateway
calls it after draining), so a clean shutdown loses nothing; a crash loses at most one
interval. A failed flush keeps its counts and retries them with the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import datetime, timedelta, timezone

from gateway.admission.redis_pipe import RedisPipe
from gateway.identity.usage import UsageLedger, usage_commands, usage_fields

log = logging.getLogger("portico.gateway.usage")


class UsageRecorder:
    """Sums usage per (tenant, UTC day, key, model) and flushes it to the ledger in the
    background.

    ``record`` never waits and never raises; ``start`` begins the periodic flush; ``flush``
    writes everything pending now; ``aclose`` stops the loop and flushes once more. With a
    ``pipe`` (admission's pipelined connection to the same Redis) a flush's commands go over
    it, encoded by hiredis, instead of through redis-py's pipeline (its Python encoding of
    some hundred ``HINCRBY`` a flush was ~2% of the gateway's event loop under load).
    """

    def __init__(
        self, ledger: UsageLedger, interval_s: float = 0.25, pipe: RedisPipe | None = None
    ) -> None:
        self._ledger = ledger
        self._pipe = pipe
        self._interval_s = interval_s
        self._pending: dict[tuple[str, str], dict[str, int]] = {}
        # (tenant, day, key id, model) -> [requests, prompt tokens, completion tokens, requests
        # whose output the gateway counted with a tokenizer, ... by the estimate, cached
        # prompt tokens, spend in micro-dollars] since the flush
        self._counts: dict[tuple[str, str, str | None, str], list[int]] = {}
        self._day = ""
        self._day_start = self._day_end = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._failing = False

    def record(
        self,
        tenant_id: str,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        source: str = "upstream",
        *,
        key_id: str | None = None,
        cached_tokens: int = 0,
        spend_micro_usd: int = 0,
    ) -> None:
        """Count one request; ``source`` is who counted its output (proxy.Usage.source),
        ``key_id`` the API key it came with (None: a JWT or admin caller)."""
        now = time.time()
        if not self._day_start <= now < self._day_end:
            self._set_day(now)
        key = (tenant_id, self._day, key_id, model)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = [0, 0, 0, 0, 0, 0, 0]
        # the hot case: three additions, the usage fields are built once per flush
        counts[0] += 1
        counts[1] += prompt_tokens
        counts[2] += completion_tokens
        if source == "tokenizer":
            counts[3] += 1
        elif source == "estimate":
            counts[4] += 1
        counts[5] += cached_tokens
        counts[6] += spend_micro_usd

    def _set_day(self, now: float) -> None:
        start = datetime.fromtimestamp(now, timezone.utc).replace(
            hour=0, minute=0, second=0, microsecond=0
        )
        self._day = start.strftime("%Y-%m-%d")
        self._day_start = start.timestamp()
        self._day_end = (start + timedelta(days=1)).timestamp()

    def _take_counts(self) -> None:
        """Turn the per-(tenant, day, key, model) sums into pending usage fields."""
        counts, self._counts = self._counts, {}
        for (tenant_id, day, key_id, model), sums in counts.items():
            requests, prompt, completion, tokenizer, estimate, cached, spend = sums
            fields = usage_fields(
                model,
                prompt,
                completion,
                requests,
                tokenizer,
                estimate,
                cached_tokens=cached,
                spend_micro_usd=spend,
                key_id=key_id,
            )
            self._add((tenant_id, day), fields)

    def _add(self, key: tuple[str, str], fields: dict[str, int]) -> None:
        into = self._pending.get(key)
        if into is None:
            self._pending[key] = fields
            return
        for field, amount in fields.items():
            into[field] = into.get(field, 0) + amount

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._interval_s)
            await self.flush()  # never cancelled half way: a batch in flight is not lost

    async def flush(self) -> None:
        """Write what is pending in one round trip; on failure keep it for the next flush."""
        self._take_counts()
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        try:
            if self._pipe is not None:
                await self._pipe.execute_many(usage_commands(batch))
            else:
                await self._ledger.add_usage(batch)
        except Exception as exc:  # Redis down or busy: retried with the next flush
            for key, fields in batch.items():
                self._add(key, fields)
            if not self._failing:
                self._failing = True
                log.warning("recording usage failed (kept, retried): %s", exc)
            return
        if self._failing:
            self._failing = False
            log.warning("recording usage works again")

    async def aclose(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush()
