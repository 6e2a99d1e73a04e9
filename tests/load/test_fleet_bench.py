"""load/fleet_bench.py's workload and arguments (the benchmark itself starts four gateways
with real engines: it is run by hand, `portico bench fleet`, never in the suite)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import yaml

from engine.config import EngineConfig
from engine.kv_cache_dtype import storage_dtype
from engine.numerics import resolve_numerics
from gateway.relay.routing import load_routing_policy
from load.fleet_bench import kv_sizing, main, parse_args, workload, write_config


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


def test_cache_fit_sizes_each_replica_to_a_share_of_the_prompts_and_the_single_to_the_fleet(
    tmp_path: Path,
) -> None:
    """--cache-fit 0.5: each replica's KV cache holds half the tenants' prompts (in the engine's
    own blocks of SmolLM2-135M: 30 layers x K and V x 3 heads x 64 x the element's bytes x 16
    tokens; the element is what --kv-cache-dtype auto stores on this CPU's default path), the
    single engine both replicas' memory; the engine reads that from its --kv-cache-memory."""
    args = parse_args(
        ["--tenants", "3", "--system-words", "100", "--cache-fit", "0.5", "--replicas", "2"]
    )
    sizing = kv_sizing(args)
    path = resolve_numerics("auto", "int8", torch.device("cpu"), gguf_blocks=True)
    dtype = storage_dtype(path.kv_cache_dtype("auto"), path.torch_dtype)
    assert dtype == torch.float16  # the default path's cache (engine.numerics)
    assert sizing["block_bytes"] == 30 * 2 * 3 * 64 * dtype.itemsize * 16
    assert 3 * 100 // 16 <= sizing["prompt_blocks"] <= 3 * 400 // 16  # ~1-4 tokens a word
    assert sizing["replica_blocks"] == math.ceil(0.5 * sizing["prompt_blocks"])
    assert sizing["replica_bytes"] == sizing["replica_blocks"] * sizing["block_bytes"]
    assert sizing["single_bytes"] == 2 * sizing["replica_bytes"]
    write_config(tmp_path, 1, "redis://127.0.0.1:1", "round_robin", 2, args,
                 sizing["replica_bytes"])  # fmt: skip
    engine = yaml.safe_load((tmp_path / "portico.yaml").read_text())["engines"][0]
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(engine["args"]))
    assert config.kv_cache_memory_bytes == sizing["replica_bytes"]


def test_without_cache_fit_every_engine_gets_the_engine_args_as_given(tmp_path: Path) -> None:
    args = parse_args([])
    write_config(tmp_path, 1, "redis://127.0.0.1:1", "prefix_aware", 2, args)
    engine = yaml.safe_load((tmp_path / "portico.yaml").read_text())["engines"][0]
    assert engine["args"] == ["--kv-cache-memory", "256MiB", "--max-model-len", "4096"]


def test_replicas_on_cuda_split_the_card(tmp_path: Path) -> None:
    """Two replicas on one GPU: each engine gets --gpu-memory-utilization 0.45 (0.9 split),
    which its own config reads; on a CPU the arguments stay as given."""
    args = parse_args(["--engine-args", "--device cuda --max-model-len 4096"])
    write_config(tmp_path, 1, "redis://127.0.0.1:1", "prefix_aware", 2, args)
    engine = yaml.safe_load((tmp_path / "portico.yaml").read_text())["engines"][0]
    assert engine["args"][-2:] == ["--gpu-memory-utilization", "0.45"]
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert (
        EngineConfig.from_cli_args(parser.parse_args(engine["args"])).gpu_memory_utilization == 0.45
    )
