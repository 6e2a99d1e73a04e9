"""GatewayConfig: defaults, every field validated, errors that name the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, GatewayConfig, load_config, parse_config
from tests.gateway.dataplane.harness import REPO_ROOT


def test_no_config_serves_the_default_model_with_embedded_redis() -> None:
    config = load_config(None)
    assert [(e.name, e.model, e.replicas) for e in config.engines] == [
        ("smollm2", "smollm2-135m", 1)
    ]
    assert config.redis.url is None and config.tls is None
    assert (config.policies_dir / "routing.yaml").is_file()


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"listen": {"port": 70000}}, "listen.port"),
        ({"engines": [{"name": "a", "replicas": 0}]}, "engines.0.replicas"),
        ({"engines": [{"name": "a", "bogus": 1}]}, "engines.0.bogus"),
        ({"unknown_section": {}}, "unknown_section"),
        ({"redis": {"url": "http://x"}}, "redis.url"),
        ({"remotes": [{"name": "r"}]}, "remotes.0.model"),
        ({"drain_timeout_s": -1}, "drain_timeout_s"),
        ({"tls": {"cert_file": "/nope.pem", "key_file": "/nope.key"}}, "cert_file"),
        ({"engines": [{"name": "a"}], "remotes": [{"name": "a", "model": "openai/x"}]}, "unique"),
        ({"admission": {"redis_down_policy": "maybe"}}, "admission.redis_down_policy"),
    ],
)
def test_invalid_fields_are_named(data: dict, named: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert named in str(exc.value)


def test_a_full_config_parses(tmp_path: Path) -> None:
    config = parse_config(
        {
            "listen": {"host": "0.0.0.0", "port": 8443},
            "redis": {"url": "redis://localhost:6379/0", "data_dir": str(tmp_path)},
            "engines": [
                {
                    "name": "small",
                    "model": "smollm2-135m",
                    "replicas": 2,
                    "args": ["--max-num-seqs", "64"],
                }
            ],
            "remotes": [
                {"name": "gpt", "model": "openai/gpt-4o-mini", "api_key_env": "OPENAI_KEY"}
            ],
            "drain_timeout_s": 10,
        }
    )
    assert isinstance(config, GatewayConfig)
    assert config.engines[0].replicas == 2 and config.remotes[0].name == "gpt"


def test_serve_refuses_a_bad_config_with_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("engines:\n  - name: x\n    replicas: many\n")
    proc = subprocess.run(
        [sys.executable, "-m", "portico.cli", "serve", "-c", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "engines.0.replicas" in proc.stderr


def test_the_example_config_is_valid() -> None:
    config = load_config(REPO_ROOT / "portico.example.yaml")
    assert config.engines[0].name == "smollm2"


def test_serve_refuses_an_engine_model_that_is_not_installed(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    path.write_text(f"engines:\n  - name: x\n    model: {tmp_path / 'no-such-model'}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "portico.cli", "serve", "-c", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "engines.0.model" in proc.stderr


def test_media_flags_override_the_config_and_are_validated() -> None:
    import argparse

    from gateway import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    config = parse_config({"media": {"allowed_domains": ["a.example"], "max_bytes": 4096}})
    args = parser.parse_args(
        ["--allowed-media-domains", "img.example", "cdn.internal",
         "--allowed-media-networks", "10.0.0.0/8", "--media-fetch-timeout-s", "3"]
    )  # fmt: skip
    cli._override_media(config, args)
    assert config.media.allowed_domains == ["img.example", "cdn.internal"]
    assert config.media.allowed_networks == ["10.0.0.0/8"] and config.media.fetch_timeout_s == 3
    assert config.media.max_bytes == 4096  # not given: the file's value stays
    policy = config.media.policy()
    assert policy.enabled and policy.host_allowed("IMG.example")
    bad = parser.parse_args(["--allowed-media-networks", "10.0.0.0/40"])
    with pytest.raises(ConfigError, match="not an IP network"):
        cli._override_media(config, bad)
    assert not parse_config({}).media.policy().enabled  # the default fetches nothing
