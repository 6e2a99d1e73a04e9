"""One gateway process for the multi-process test: admits as fast as it can for one tenant.

Run as ``python admission_worker.py REDIS_URL ATTEMPTS RPM``; prints "ready", waits for a line
on stdin (so every worker starts together), then prints {"admitted": n} as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys

from redis.asyncio import BlockingConnectionPool, Redis

from gateway.admission.admission import Admission, AdmissionSettings, LimitExceededError
from gateway.identity.principal import Limits, Principal

CONCURRENCY = 8


async def main(url: str, attempts: int, rpm: int) -> int:
    pool = BlockingConnectionPool.from_url(url, max_connections=CONCURRENCY, timeout=None)
    redis = Redis.from_pool(pool)
    admission = Admission(redis, AdmissionSettings(redis_down_policy="closed"))
    who = Principal(tenant_id="shared", plan="p", limits=Limits(requests_per_minute=rpm))
    await redis.ping()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    admitted = 0
    remaining = attempts

    async def hammer() -> None:
        nonlocal admitted, remaining
        while remaining > 0:
            remaining -= 1
            try:
                ticket = await admission.admit(who, "m", 1, 1)
            except LimitExceededError:
                continue
            admitted += 1
            await admission.release(ticket)

    await asyncio.gather(*(hammer() for _ in range(CONCURRENCY)))
    print(json.dumps({"admitted": admitted}), flush=True)
    await redis.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
