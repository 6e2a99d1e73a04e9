"""The ground every part stands on: the CLI, model resolution, the shared fixtures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portico import cli, registry


def test_help_lists_only_subcommands_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name, (module, _) in cli.SUBCOMMANDS.items():
        present = cli._load(module) is not None
        assert (f"    {name} " in out) == present, name


def test_models_list_shows_the_default_model() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "portico.cli", "models", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "smollm2-135m" in out
    assert ".gguf" in out


def test_models_pull_of_unknown_alias_fails_with_the_known_names() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "portico.cli", "models", "pull", "no-such-model"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "smollm2-135m" in proc.stderr


def test_resolve_accepts_alias_gguf_path_and_hf_folder(
    tiny_llama_dir: Path, smollm2_gguf: Path
) -> None:
    assert registry.resolve("smollm2-135m").format == "gguf"
    assert registry.resolve(str(smollm2_gguf)).path == smollm2_gguf
    hf = registry.resolve(tiny_llama_dir)
    assert hf.format == "hf"
    assert json.loads((hf.path / "config.json").read_text())["num_hidden_layers"] == 2


def test_missing_model_names_it_and_the_fetch_command(tmp_path: Path) -> None:
    with pytest.raises(registry.ModelNotFound) as info:
        registry.resolve(tmp_path / "nope")
    assert "nope" in str(info.value)
    assert "portico models pull" in str(info.value)


def test_tiny_llama_has_a_real_tokenizer_with_chat_template(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok("Hello, world")["input_ids"]
    assert tok.decode(ids) == "Hello, world"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in text


def test_redis_fixture_is_a_real_server_with_lua(redis_url: str) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    assert r.eval("return redis.call('TIME')[1] + 0", 0) > 0


@pytest.mark.parametrize(
    ("user_env", "spin_count"),
    [
        ({}, "0"),  # nothing chosen: portico's passive waiting (no spin)
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),  # the user's choice wins
        ({"GOMP_SPINCOUNT": "5"}, "5"),
    ],
)
def test_the_openmp_runtime_an_engine_loads_waits_as_portico_defaults_unless_the_user_chose(
    user_env: dict[str, str], spin_count: str
) -> None:
    """What libgomp itself read at load (OMP_DISPLAY_ENV) under ``portico engine``: the
    default reaches the runtime, and a user's own setting is not overridden."""
    env = {k: v for k, v in os.environ.items() if k not in cli.OPENMP_USER_SETTINGS}
    result = subprocess.run(
        [sys.executable, "-m", "portico.cli", "engine", "--help"],
        env=env | user_env | {"OMP_DISPLAY_ENV": "VERBOSE"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"GOMP_SPINCOUNT = '{spin_count}'" in result.stderr


def test_openmp_defaults_add_nothing_to_an_environment_that_chose_its_waiting() -> None:
    assert cli.openmp_defaults({"PATH": "/bin"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    for name in cli.OPENMP_USER_SETTINGS:
        assert cli.openmp_defaults({name: "anything"}) == {}
