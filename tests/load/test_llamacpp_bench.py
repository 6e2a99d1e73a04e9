"""``load/llamacpp_bench.py``'s command lines: the "defaults" rows run what ``make run`` runs
(no flag ``portico serve`` would not pass, none of the benchmark's OpenMP tuning) and what a
user of ``llama-server -m FILE`` gets."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.server.cli import add_arguments
from gateway.config import GatewayConfig
from gateway.lifecycle import _engine_command
from load.llamacpp_bench import defaults_engine_command, llama_command, tuned_extra
from load.standard import ENGINE_FLAGS


def _engine_config(argv: list[str]) -> EngineConfig:
    """The EngineConfig ``portico engine`` builds from ``argv`` (the words after ``engine``)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return EngineConfig.from_cli_args(parser.parse_args(argv))


def test_the_defaults_engine_is_configured_as_portico_serve_configures_its_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", "30000")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cmd, env = defaults_engine_command(8123)
    ours = cmd[cmd.index("engine") + 1 :]
    config = GatewayConfig()  # `make run`: portico serve with no config file
    spec = config.engines[0]
    served = _engine_command(spec, "r0", Path("/tmp/r0.sock"), config.engine.scheduling)
    gateways = served[served.index("engine") + 1 :]
    assert _engine_config(ours) == _engine_config(gateways)
    assert "--dtype" not in ours and not {"GOMP_SPINCOUNT", "OMP_NUM_THREADS"} & env.keys()


def test_llama_server_default_slots_pass_no_threads_slots_or_context() -> None:
    model = Path("/models/m.gguf")
    default = llama_command("llama-server", model, 9000, "default", 2, 1024)
    assert not {"-t", "-np", "-c"} & set(default) and default[1:3] == ["-m", str(model)]
    tuned = llama_command("llama-server", model, 9000, "16", 2, 1024)
    assert tuned[-6:] == ["-t", "2", "-np", "16", "-c", str(16 * 1024)]


def test_the_tuned_row_serves_the_default_numerics_unless_its_flags_name_a_dtype() -> None:
    """The side by side with llama.cpp measures the default (issue 42's requirement 3):
    make bench's serving flags, the default dtype; ``--portico-flags`` can still pick bf16."""
    assert _engine_config([*ENGINE_FLAGS, *tuned_extra("")]).dtype == "auto"
    assert _engine_config([*ENGINE_FLAGS]).dtype == "bfloat16"
    bf16 = _engine_config([*ENGINE_FLAGS, *tuned_extra("--dtype bfloat16")])
    assert bf16.dtype == "bfloat16"
    assert _engine_config([*ENGINE_FLAGS, *tuned_extra("")]).max_num_seqs == 64
