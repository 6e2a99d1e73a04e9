"""Faults with real processes, counting what the clients received: Redis killed and restarted
under load for each outage policy, a second gateway on the same data dir, an engine SIGKILLed
under load, and a request asking for more completions than its tenant's tokens allow."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.gateway.dataplane.harness import (
    GatewayProcess,
    fake_engine_command,
    live_slots,
    tiny_engine,
    wait_until,
)
from tests.hardening.conftest import MODEL, start_hardened_gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
NUM_CLIENTS = 4


def gauge(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


class Load:
    """``NUM_CLIENTS`` threads sending one request after another, each status counted in the
    phase it was sent and answered in; one whose phase changed while it was in flight (sent
    while Redis was up, answered after it was stopped) is counted under ``"sent->answered"``,
    so no phase holds an answer to another phase's conditions."""

    def __init__(self, url: str, key: str, body: dict[str, Any]) -> None:
        self.url, self.key, self.body = url, key, body
        self.phase = "before"
        self.counts: dict[str, Counter[str]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run) for _ in range(NUM_CLIENTS)]

    def _run(self) -> None:
        with httpx.Client(headers={"authorization": f"Bearer {self.key}"}, timeout=60) as client:
            while not self._stop.is_set():
                phase = self.phase
                try:
                    r = client.post(self.url + "/v1/chat/completions", json=self.body)
                    outcome = str(r.status_code)
                    if r.status_code >= 400:
                        outcome += ":" + str(r.json()["error"]["code"])
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                if self.phase != phase:
                    phase = f"{phase}->{self.phase}"
                with self._lock:
                    self.counts.setdefault(phase, Counter())[outcome] += 1

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def served(self, phase: str, at_least: int) -> bool:
        with self._lock:
            return sum(self.counts.get(phase, Counter()).values()) >= at_least


# ------------------------------------------------------------------------ Redis outage


@pytest.mark.parametrize("policy", ["local", "open", "closed"])
def test_redis_killed_and_restarted_under_load(tmp_path: Path, policy: str) -> None:
    gw = start_hardened_gateway(
        tmp_path,
        admission={"redis_down_policy": policy, "probe_interval_seconds": 0.2},
        # No key cache: every request during the outage needs the outage copy (or is refused),
        # whatever the timing, instead of riding on a 2 s cache.
        auth={"key_cache_ttl_seconds": 0},
    )
    try:
        tenant_id, key = gw.process.create_tenant("standard")
        with Load(gw.url, key, CHAT) as load:
            assert wait_until(lambda: load.served("before", 20), timeout=60)
            redis.Redis.from_url(gw.redis.url).save()  # the restarted server loads this
            load.phase = "outage"
            gw.redis.stop()
            assert wait_until(lambda: gauge(gw.url, "portico_admission_redis_up") == 0, 30)
            ready = httpx.get(gw.url + "/ready", timeout=10)
            assert ready.json()["redis"] == "down"
            assert ready.status_code == (503 if policy == "closed" else 200)
            load.phase = "outage-seen"  # the probe has seen it: counted from here
            assert wait_until(lambda: load.served("outage-seen", 20), timeout=60)
            load.phase = "restart"
            gw.redis.start()
            assert wait_until(lambda: gauge(gw.url, "portico_admission_redis_up") == 1, 30)
            load.phase = "after"  # the timed probe found Redis: Redis judges from here
            assert wait_until(lambda: load.served("after", 20), timeout=60)
        print(f"policy {policy}: what the clients received, by phase: {load.counts}")
        before, during, after = (load.counts[p] for p in ("before", "outage-seen", "after"))
        assert set(before) == {"200"}
        # Sent while Redis was up, answered after it was stopped: under policy closed such a
        # request may be refused (no outage copy of keys), one per client at most; the other
        # policies answer it.
        in_flight = load.counts.get("before->outage", Counter())
        refused = {k: v for k, v in in_flight.items() if k != "200"}
        if policy == "closed":
            assert set(refused) <= {"503:rate_limiter_unavailable", "503:service_unavailable"}
            assert sum(refused.values()) <= NUM_CLIENTS
        else:
            assert not refused, in_flight
        if policy == "closed":
            assert set(during) <= {"503:rate_limiter_unavailable", "503:service_unavailable"}
        else:  # keys verified before the outage keep working for the whole outage
            assert set(during) == {"200"}, during
        assert set(after) == {"200"}, after  # no wrong 429 from an exhausted local bucket
        # Slots taken in Redis by requests in flight when it died cannot be released while it
        # is down; the restarted server still has them until their lease runs out
        # (admission.slot_lease_seconds). At most one per client: nothing else leaks.
        held = gw.live_slots(tenant_id)
        print(f"policy {policy}: slots held after the restart: {held}")
        assert held <= NUM_CLIENTS
    finally:
        gw.process.terminate()
        gw.redis.stop()


# ------------------------------------------------------------------ one owner per data dir


def embedded_gateway(workdir: Path, data_dir: Path) -> GatewayProcess:
    return GatewayProcess(
        workdir,
        {
            "redis": {"data_dir": str(data_dir)},
            "engines": [{"name": MODEL, "replicas": 1, "command": fake_engine_command()}],
        },
        {},
        {},
    )


@pytest.fixture
def first_gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    gw = embedded_gateway(tmp_path / "first", tmp_path / "data")
    (tmp_path / "first").mkdir(exist_ok=True)
    gw.start(timeout=120)
    yield gw
    gw.terminate()


def test_a_second_gateway_on_the_same_data_dir_exits_naming_the_first(
    tmp_path: Path, first_gateway: GatewayProcess
) -> None:
    _, key = first_gateway.create_tenant("standard")
    (tmp_path / "second").mkdir()
    second = embedded_gateway(tmp_path / "second", tmp_path / "data")
    with pytest.raises(RuntimeError) as info:
        second.start(timeout=60)
    assert first_gateway.proc is not None
    message = str(info.value)
    assert "exited 2" in message
    assert f"PID {first_gateway.proc.pid}" in message and f"port {first_gateway.port}" in message
    # the first gateway and its embedded Redis are untouched
    r = httpx.post(
        first_gateway.base_url + "/v1/chat/completions",
        json=CHAT,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert gauge(first_gateway.base_url, "portico_admission_redis_up") == 1


def test_the_embedded_redis_files_are_private(
    tmp_path: Path, first_gateway: GatewayProcess
) -> None:
    first_gateway.create_tenant("standard")
    data = tmp_path / "data"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    files = [p for p in data.rglob("*") if p.is_file()]
    assert files
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {
        p.name: "0o600" for p in files
    }


def test_readiness_and_the_gauge_follow_the_embedded_redis(
    tmp_path: Path, first_gateway: GatewayProcess
) -> None:
    settings = json.loads((tmp_path / "data" / "portico-redis.db.settings").read_text())
    pid = int(Path(settings["pidfile"]).read_text())
    assert gauge(first_gateway.base_url, "portico_admission_redis_up") == 1
    os.kill(pid, signal.SIGKILL)  # the store dies; no request arrives to notice it
    assert wait_until(
        lambda: gauge(first_gateway.base_url, "portico_admission_redis_up") == 0, timeout=30
    )
    assert httpx.get(first_gateway.base_url + "/ready", timeout=10).json()["redis"] == "down"


# ---------------------------------------------------------------- real engine processes


@pytest.fixture(scope="module")
def engine_gateway(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    from tests.conftest import RedisServer

    workdir = tmp_path_factory.mktemp("engine-faults")
    store = RedisServer(workdir / "redis")
    store.start()
    gw = GatewayProcess(
        workdir,
        {
            "redis": {"url": store.url},
            "engines": [tiny_engine(tiny_llama_dir)],
            "supervisor": {"backoff_base_s": 0.2},
        },
        {},
        {},
    )
    gw.redis_url = store.url  # type: ignore[attr-defined]
    gw.start()
    yield gw
    gw.terminate()
    store.stop()


def stream_outcome(url: str, key: str) -> str:
    """How one streaming request ended, as its client saw it."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=120,
        ) as r:
            if r.status_code != 200:
                return f"{r.status_code}:{json.loads(r.read())['error']['code']}"
            events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    except httpx.HTTPError as exc:
        return type(exc).__name__
    if events[-1:] != ["data: [DONE]"]:
        return "cut-without-done"
    if any('"error"' in e for e in events):
        return "error-event"
    finished = any('"finish_reason":"length"' in e.replace(" ", "") for e in events)
    return "complete" if finished else "done-without-finish"


@pytest.mark.slow
def test_an_engine_sigkilled_under_load_fails_its_requests_cleanly(
    engine_gateway: GatewayProcess,
) -> None:
    tenant_id, key = engine_gateway.create_tenant("standard")
    engines = engine_gateway.health()["engines"]
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def client() -> None:
        outcome = stream_outcome(engine_gateway.base_url, key)
        with lock:
            outcomes[outcome] += 1

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    assert wait_until(
        lambda: any(e["outstanding"] for e in engine_gateway.health()["engines"]), timeout=60
    )
    os.kill(engines[0]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    print(f"what 6 streaming clients received when the engine was killed: {dict(outcomes)}")
    assert sum(outcomes.values()) == 6
    # every request ended in a way its client can tell: finished, or an error it can see
    assert set(outcomes) <= {
        "complete",
        "error-event",
        "503:no_healthy_replica",
        "502:upstream_error",
    }
    assert wait_until(
        lambda: engine_gateway.health()["engines"][0]["state"] == "ready", timeout=240
    )
    assert stream_outcome(engine_gateway.base_url, key) == "complete"
    assert wait_until(lambda: live_slots(engine_gateway.redis_url, tenant_id) == 0, timeout=30)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_every_completion_a_request_asks_for_is_reserved(engine_gateway: GatewayProcess) -> None:
    tenant_id, key = engine_gateway.create_tenant("standard", overrides={"tokens_per_minute": 40})
    headers = {"authorization": f"Bearer {key}"}
    messages = [{"role": "user", "content": "hi"}]
    url = engine_gateway.base_url + "/v1/chat/completions"
    # 16 completions of 4 tokens cannot fit 40 tokens a minute, whatever the prompt
    r = httpx.post(
        url,
        json={"model": "tiny", "messages": messages, "n": 16, "max_tokens": 4},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 429, r.text
    # no max_tokens: the engine is sent what was reserved, so it never generates more
    r = httpx.post(
        url,
        json={"model": "tiny", "messages": messages, "n": 4, "ignore_eos": True},
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert len(r.json()["choices"]) == 4
    assert usage["total_tokens"] <= 40, usage


@pytest.mark.slow
def test_continuous_usage_reaches_the_client_only_with_include_usage(
    engine_gateway: GatewayProcess,
) -> None:
    _, key = engine_gateway.create_tenant("standard")
    for options, want_usage in (
        ({"continuous_usage_stats": True}, False),
        ({"continuous_usage_stats": True, "include_usage": True}, True),
    ):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": options,
        }
        r = httpx.post(
            engine_gateway.base_url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        with_usage = [c for c in chunks if c.get("usage")]
        assert (len(with_usage) == len(chunks)) if want_usage else not with_usage, chunks
