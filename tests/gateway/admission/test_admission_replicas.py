"""Two gateway processes sharing one Redis never admit more than the shared limit allows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis

WORKER = Path(__file__).with_name("admission_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[3]


def redis_time_s(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def test_two_processes_hammering_one_tenant_stay_within_the_limit(redis_url: str) -> None:
    rpm, attempts = 600, 700  # capacity 600, refill 10 per second
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), redis_url, str(attempts), str(rpm)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    client = redis.Redis.from_url(redis_url)
    try:
        for w in workers:
            assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        start = redis_time_s(client)
        for w in workers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        outputs = [w.communicate(timeout=120)[0] for w in workers]
        end = redis_time_s(client)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        client.close()
    assert [w.returncode for w in workers] == [0, 0]
    admitted = [json.loads(out.strip().splitlines()[-1])["admitted"] for out in outputs]
    window_s = end - start
    assert sum(admitted) <= rpm + rpm * window_s / 60
    assert sum(admitted) >= rpm  # the burst was there to take, and it was all taken
    assert all(n > 0 for n in admitted)  # both processes really competed
