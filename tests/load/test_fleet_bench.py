"""load/fleet_bench.py's workload and arguments (the benchmark itself starts four gateways
with real engines: it is run by hand, `portico bench fleet`, never in the suite)."""

from __future__ import annotations

from pathlib import Path

from gateway.dataplane.routing import load_routing_policy
from load.fleet_bench import main, parse_args, workload, write_config


def test_workload_is_seeded_interleaved_and_one_system_prompt_per_tenant() -> None:
    args = parse_args(["--tenants", "3", "--questions", "4", "--system-words", "50"])
    reqs = workload(args)
    assert reqs == workload(args)  # the same order for every policy
    assert len(reqs) == 12
    systems = {t: m[0]["content"] for t, m in reqs}
    assert len(set(systems.values())) == 3
    assert all(m[0]["content"] == systems[t] for t, m in reqs)
    assert [t for t, _ in reqs] != sorted(t for t, _ in reqs)  # interleaved, not grouped
    assert workload(parse_args(["--tenants", "3", "--questions", "4", "--seed", "1"])) != reqs


def test_unknown_policy_is_refused_before_anything_starts() -> None:
    assert main(["--policies", "prefix_aware,fastest"]) == 2


def test_load_only_is_least_loaded_without_prefix_affinity(tmp_path: Path) -> None:
    """The baseline without any prefix knowledge: least_loaded's rendezvous affinity on the
    prompt's first characters is off (prefix_chars 0), so only load decides."""
    args = parse_args([])
    write_config(tmp_path, 1, "redis://127.0.0.1:1", "load_only", 2, args)
    routing = load_routing_policy(tmp_path / "policies" / "routing.yaml")
    assert (routing.replica_policy, routing.prefix_chars) == ("least_loaded", 0)
