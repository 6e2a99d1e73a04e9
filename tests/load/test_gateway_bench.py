"""The gateway benchmark's pieces: its config, tenants made through the admin API, the request
mix, the overhead math and the rate-limit check, run briefly against a real ``portico serve``
in front of the fake upstream. Functional only: no timing is asserted."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import load_config
from load import gateway_bench as gb
from load import gateway_stack as gs
from load.open_loop import Sample, closed_loop, open_loop, run_async


def test_config_is_valid_and_pins_the_fake_engines(tmp_path: Path) -> None:
    path = gs.write_gateway_files(tmp_path, 8123, "unix:///tmp/r.sock", upstream_cpus=None)
    config = load_config(path)
    assert [e.name for e in config.engines] == list(gs.MODELS)
    assert config.listen.port == 8123 and config.redis.url == "unix:///tmp/r.sock"
    assert all("{uds}" in e.command for e in config.engines if e.command)
    assert config.redis.plans_file is not None
    assert "bench" in config.redis.plans_file.read_text()
    if shutil.which("taskset"):
        pinned = load_config(gs.write_gateway_files(tmp_path, 8123, "unix:///r", upstream_cpus="1"))
        assert pinned.engines[0].command is not None
        assert pinned.engines[0].command[1:3] == ["-c", "1"]


def test_overhead_is_gateway_minus_direct_per_percentile() -> None:
    direct = {"mean": 1.0, "median": 0.5, "p90": 0.9, "p99": 2.0}
    through = {"mean": 2.0, "median": 1.25, "p90": 1.5, "p99": 6.0}
    assert gb.overhead(direct, through) == {"median_ms": 0.75, "p90_ms": 0.6, "p99_ms": 4.0}


def test_latency_stats_use_first_chunk_for_streams_and_skip_failures() -> None:
    samples = [
        Sample("stream", "t", 200, first_s=0.001, total_s=0.010),
        Sample("stream", "t", 503, first_s=0.5, total_s=0.5),
        Sample("json", "t", 200, first_s=0.004, total_s=0.004),
    ]
    stream = gb.latency_stats(samples, "stream")
    assert stream["count"] == 1 and stream["median"] == pytest.approx(1.0)
    assert gb.latency_stats(samples, "json")["median"] == pytest.approx(4.0)


def _samples(tenant: str, admitted: int, limited: int, other: int = 0) -> list[Sample]:
    return (
        [Sample("json", tenant, 200)] * admitted
        + [Sample("json", tenant, 429)] * limited
        + [Sample("json", tenant, 500)] * other
        + [Sample("json", "someone-else", 200)] * 7
    )


def test_rate_limit_check_bounds() -> None:
    tenant = gb.BenchTenant("t1", ("sk-x",), requests_per_minute=30)
    good = gb.rate_limit_check(tenant, _samples("t1", 31, 69), elapsed_s=4.0)
    assert good["ok"] and good["sent"] == 100 and good["expected_max"] == pytest.approx(32.0)
    assert not gb.rate_limit_check(tenant, _samples("t1", 33, 67), elapsed_s=4.0)["ok"]
    assert not gb.rate_limit_check(tenant, _samples("t1", 25, 75), elapsed_s=4.0)["ok"]
    broken = gb.rate_limit_check(tenant, _samples("t1", 30, 69, other=1), elapsed_s=4.0)
    assert broken["other"] == 1 and not broken["ok"]
    with pytest.raises(ValueError, match="no requests/min"):
        gb.rate_limit_check(gb.BenchTenant("t2", ()), [], 1.0)


def test_shots_cover_every_key_model_kind_and_mode() -> None:
    tenants = [gb.BenchTenant("a", ("sk-1", "sk-2")), gb.BenchTenant("b", ("sk-3",))]
    shots = gb.build_shots("127.0.0.1:1", tenants)
    assert len(shots) == 3 * len(gs.MODELS) * 2 * 2
    assert {s.label for s in shots} == {"json", "stream"}
    assert sum(b"Bearer sk-3" in s.raw for s in shots) == len(gs.MODELS) * 4
    head, _, body = shots[0].raw.partition(b"\r\n\r\n")
    assert f"content-length: {len(body)}".encode() in head.lower()
    assert json.loads(body)["stream"] == (shots[0].label == "stream")


def test_wrk_script_holds_each_request() -> None:
    shots = gb.build_shots("127.0.0.1:1", [gb.BenchTenant("a", ("sk-1",))])
    script = gb.wrk_script(shots)
    assert script.count("wrk.format(") == len(shots)
    assert '["Authorization"] = "Bearer sk-1"' in script and "WRKJSON" in script


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[gs.GatewayHandle, int]]:
    """redis-server, the direct fake upstream and a gateway with two fake engines, unpinned."""
    workdir = tmp_path_factory.mktemp("gwbench")
    with contextlib.ExitStack() as es:
        redis_url = es.enter_context(gs.redis_server(workdir, None))
        direct = es.enter_context(gs.direct_upstream(workdir, None))
        gw = es.enter_context(gs.gateway(workdir, redis_url, None, None))
        yield gw, direct


def test_tenants_and_keys_are_made_through_the_admin_api(
    stack: tuple[gs.GatewayHandle, int],
) -> None:
    gw, _ = stack
    base = f"http://127.0.0.1:{gw.port}"
    tenants = gb.create_tenants(base, gw.admin_key, 2, 2, prefix="adm")
    listed = httpx.get(
        base + "/admin/v1/tenants", headers={"authorization": f"Bearer {gw.admin_key}"}
    ).json()["data"]
    assert {t.tenant_id for t in tenants} <= {t["id"] for t in listed}
    for tenant in tenants:
        assert len(set(tenant.keys)) == 2 and all(k.startswith("sk-") for k in tenant.keys)
    with pytest.raises(httpx.HTTPStatusError):
        gb.create_tenants(base, "sk-admin-wrong-key-0123456789", 1, 1)


def test_new_tenant_key_makes_the_tenant_on_its_plan_and_a_key_it_serves(
    stack: tuple[gs.GatewayHandle, int],
) -> None:
    """The benches' one way to get a tenant's key (batch, fleet, fresh-clone, cache-timing,
    soak): the tenant exists with the plan asked for, and its key is served."""
    gw, _ = stack
    base = f"http://127.0.0.1:{gw.port}"
    with gs.admin_client(base, gw.admin_key) as admin:
        key = gs.new_tenant_key(admin, {"id": "helper-t", "name": "helper-t", "plan": "open"})
        tenant = admin.get("/admin/v1/tenants/helper-t").json()
    assert tenant["plan"] == "open"
    models = httpx.get(base + "/v1/models", headers={"authorization": f"Bearer {key}"})
    assert models.status_code == 200
    with gs.admin_client(base, "sk-admin-wrong-key-0123456789") as wrong:
        with pytest.raises(httpx.HTTPStatusError):
            gs.new_tenant_key(wrong, {"id": "helper-u", "name": "helper-u"})


def test_every_shot_is_served_through_the_gateway_and_directly(
    stack: tuple[gs.GatewayHandle, int],
) -> None:
    gw, direct = stack
    tenants = gb.create_tenants(f"http://127.0.0.1:{gw.port}", gw.admin_key, 2, 1, prefix="mix")
    for port in (gw.port, direct):
        shots = gb.build_shots(f"127.0.0.1:{port}", tenants)
        samples = run_async(open_loop("127.0.0.1", port, shots, 100.0, len(shots)))
        assert [s.status for s in samples] == [200] * len(shots), [s.error for s in samples]
        assert all(0 < s.first_s <= s.total_s for s in samples)
        assert all((s.overhead_ms is not None) == (port == gw.port) for s in samples)


def test_bad_key_is_refused_not_counted(stack: tuple[gs.GatewayHandle, int]) -> None:
    gw, _ = stack
    shots = gb.build_shots(f"127.0.0.1:{gw.port}", [gb.BenchTenant("x", ("sk-not-a-key",))])
    samples, _ = run_async(closed_loop("127.0.0.1", gw.port, shots, 2, num_requests=4))
    assert {s.status for s in samples} == {401}


def test_a_30_per_minute_tenant_hammered_with_100_is_held_to_its_bucket(
    stack: tuple[gs.GatewayHandle, int],
) -> None:
    gw, _ = stack
    base = f"http://127.0.0.1:{gw.port}"
    bench = gb.create_tenants(base, gw.admin_key, 1, 2, prefix="bg")
    limited = gb.create_tenants(base, gw.admin_key, 1, 1, "lim", requests_per_minute=30)
    result = gb.limits_under_load(gw.port, bench, limited, rate=50.0, duration_s=1.0, hammer=100)
    check = result["tenants"][0]
    assert check["sent"] == 100 and check["other"] == 0
    assert 30 <= check["admitted"] <= check["expected_max"]
    assert check["admitted"] + check["limited_429"] == 100
    assert result["ok"] and result["background_errors"] == 0


@pytest.mark.slow  # the benchmark's fixed-rate rounds, end to end on both sides
def test_fixed_rate_reports_overhead_and_gateway_cpu(stack: tuple[gs.GatewayHandle, int]) -> None:
    gw, direct = stack
    tenants = gb.create_tenants(f"http://127.0.0.1:{gw.port}", gw.admin_key, 1, 2, prefix="fr")
    unlimited = gb.create_tenants(
        f"http://127.0.0.1:{gw.port}", gw.admin_key, 1, 1, "op", plan="open"
    )
    out = gb.fixed_rate(
        direct, gw, tenants, rate=40.0, duration_s=0.5, rounds=2, open_tenants=unlimited
    )
    assert out["requests_per_side"] == 40
    for side in ("direct", "gateway", "gateway_limits_off"):
        assert out[side]["errors"] == 0
        assert out[side]["json"]["count"] + out[side]["stream"]["count"] == 40
    for label in ("json", "stream"):
        assert set(out["overhead"][label]) == {"median_ms", "p90_ms", "p99_ms"}
        assert set(out["limits_cost"][label]) == {"median_ms", "p90_ms", "p99_ms"}
    assert out["gateway"]["cpu_ms_per_request"] > 0
    assert "cpu_ms_per_request" not in out["direct"]


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
def test_wrk_saturation_counts_only_successes(
    stack: tuple[gs.GatewayHandle, int], tmp_path: Path
) -> None:
    gw, _ = stack
    tenants = gb.create_tenants(f"http://127.0.0.1:{gw.port}", gw.admin_key, 1, 1, prefix="wrk")
    shots = gb.build_shots(f"127.0.0.1:{gw.port}", tenants)
    ok = gb.run_wrk(f"http://127.0.0.1:{gw.port}", shots, 1, 4, None, tmp_path)
    assert ok["requests"] > 0 and ok["non2xx"] == 0 and ok["requests_per_s"] > 0
    bad = gb.build_shots(f"127.0.0.1:{gw.port}", [gb.BenchTenant("x", ("sk-wrong",))])
    refused = gb.run_wrk(f"http://127.0.0.1:{gw.port}", bad, 1, 2, None, tmp_path)
    assert refused["non2xx"] == refused["requests"] > 0 and refused["requests_per_s"] == 0


def test_verdicts_name_each_target() -> None:
    result = {
        "fixed_rate": [
            {
                "rate": 200.0,
                "overhead": {
                    "json": {"median_ms": 0.5, "p90_ms": 1.0, "p99_ms": 7.0},
                    "stream": {"median_ms": 2.0, "p90_ms": 2.0, "p99_ms": 3.0},
                },
            }
        ],
        "saturation": {
            "gateway_json": {"requests_per_s": 1600.0},
            "gateway_stream": {"error": "wrk failed"},
        },
        "rate_limits": {
            "ok": True,
            "tenants": [{"admitted": 31, "sent": 100, "expected_max": 31.5}],
        },
    }
    met = {v["target"]: v["met"] for v in gb.verdicts(result)}
    assert met["added p50 latency (json) <= 1 ms at 200 req/s"] is True
    assert met["added p99 latency (json) <= 5 ms at 200 req/s"] is False
    assert met["added p50 time to first chunk (stream) <= 1 ms at 200 req/s"] is False
    assert met["gateway >= 1500 req/s on one core (json)"] is True
    assert not any("(stream)" in t and "req/s on one core" in t for t in met)
    assert len(met) == 6


def test_requests_per_cpu_second_is_judged_only_when_the_gateway_was_saturated() -> None:
    def judged(share: float, per_cpu_s: float) -> dict[str, object]:
        run_ = {"requests_per_s": 4000.0, "core_share": share, "requests_per_cpu_second": per_cpu_s}
        sat = {"saturation": {"gateway_json": run_}}
        (verdict,) = [v for v in gb.verdicts(sat) if "CPU-second" in str(v["target"])]
        return verdict

    assert judged(0.95, 5200.0)["met"] is True
    assert judged(0.95, 4800.0)["met"] is False
    starved = judged(0.3, 9000.0)  # a starved run's figure is no verdict either way
    assert starved["met"] is False and "not saturated" in str(starved["measured"])
