"""deploy/compose: `docker-compose config` accepts the file, and what it wires together holds up
(secrets only from the env file, Redis durable and password-protected, every nginx placeholder
set, every mounted file present, a GPU profile); the Dockerfile runs as non-root; the gateway
config the compose file mounts is valid for GatewayConfig.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from edge_nginx import REPO_ROOT, TEMPLATE, placeholders

COMPOSE_DIR = REPO_ROOT / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
ENV_EXAMPLE = COMPOSE_DIR / "env.example"


def _compose(docker_compose: str, env_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [docker_compose, "--env-file", str(env_file), "-f", str(COMPOSE_FILE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=COMPOSE_DIR,
    )


@pytest.fixture(scope="module")
def resolved(docker_compose: str) -> dict[str, Any]:
    """The compose file as docker-compose resolves it with env.example's values."""
    result = _compose(
        docker_compose, ENV_EXAMPLE, "--profile", "gpu", "--profile", "tracing", "config"
    )
    assert result.returncode == 0, result.stderr
    return dict(yaml.safe_load(result.stdout))


def _env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def test_compose_config_validates(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert set(services) == {
        "redis", "gateway", "gateway-gpu", "nginx", "prometheus", "grafana",
        "otel-collector", "jaeger",
    }  # fmt: skip
    assert services["otel-collector"]["profiles"] == services["jaeger"]["profiles"] == ["tracing"]


def test_tracing_profile_adds_a_collector_and_jaeger(docker_compose: str) -> None:
    result = _compose(docker_compose, ENV_EXAMPLE, "--profile", "tracing", "config")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert {"otel-collector", "jaeger"} <= set(services)
    collector = services["otel-collector"]
    assert any("collector.yaml" in str(v) for v in collector["volumes"])
    gateway_env = services["gateway"]["environment"]
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in gateway_env  # empty in env.example: tracing off
    config = yaml.safe_load((COMPOSE_DIR / "otel" / "collector.yaml").read_text())
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    assert config["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"


def test_a_missing_secret_stops_compose_with_its_name(docker_compose: str, tmp_path: Path) -> None:
    partial = tmp_path / "partial.env"
    partial.write_text(
        "".join(f"{k}={v}\n" for k, v in _env_example().items() if k != "PORTICO_KEY_HASH_SECRET")
    )
    result = _compose(docker_compose, partial, "config")
    assert result.returncode != 0
    assert "PORTICO_KEY_HASH_SECRET" in result.stderr


def test_every_required_variable_is_in_env_example() -> None:
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", COMPOSE_FILE.read_text()))
    assert required == {
        "REDIS_PASSWORD",
        "PORTICO_ADMIN_KEY",
        "PORTICO_KEY_HASH_SECRET",
        "GRAFANA_ADMIN_PASSWORD",
    }
    assert required <= set(_env_example())


def test_no_secret_is_written_into_the_compose_file() -> None:
    text = COMPOSE_FILE.read_text()
    for name in (
        "REDIS_PASSWORD",
        "PORTICO_ADMIN_KEY",
        "PORTICO_KEY_HASH_SECRET",
        "GF_SECURITY_ADMIN_PASSWORD",
    ):
        for line in text.splitlines():
            if re.match(rf"\s*{name}:", line):
                assert "${" in line, line  # always from .env, never a literal


def test_redis_is_durable_and_its_password_stays_off_the_command_line(
    resolved: dict[str, Any],
) -> None:
    redis = resolved["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    # read from stdin inside the container (`$$` is compose's escaped `$`)
    assert "requirepass $$REDIS_PASSWORD" in command
    assert "--requirepass" not in command
    assert any(v.endswith(":/data:rw") or v.endswith(":/data") for v in _volumes(redis))
    assert "healthcheck" in redis
    gateway_env = resolved["services"]["gateway"]["environment"]
    password = _env_example()["REDIS_PASSWORD"]
    assert gateway_env["PORTICO_REDIS_URL"] == f"redis://:{password}@redis:6379/0"


def _volumes(service: dict[str, Any]) -> list[str]:
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            out.append(v)
        else:
            out.append(f"{v.get('source')}:{v['target']}")
    return out


def test_gateway_is_healthchecked_drains_and_runs_unprivileged(resolved: dict[str, Any]) -> None:
    for name in ("gateway", "gateway-gpu"):
        gw = resolved["services"][name]
        assert "/ready" in " ".join(gw["healthcheck"]["test"])
        assert gw["cap_drop"] == ["ALL"]
        assert gw.get("user") in (None, "10001:10001")  # the image's non-root user
        assert gw["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "ports" not in gw  # reached through nginx only
        assert gw["init"] is True
    gpu = resolved["services"]["gateway-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert "cu1" in gpu["build"]["args"]["TORCH_INDEX_URL"]  # a CUDA build of torch
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "gateway" in gpu["networks"]["backend"]["aliases"]


def test_nginx_service_sets_every_template_placeholder(resolved: dict[str, Any]) -> None:
    nginx = resolved["services"]["nginx"]
    env = nginx["environment"]
    assert placeholders(TEMPLATE.read_text()) <= set(env)
    assert env["NGINX_ENVSUBST_FILTER"] == "PORTICO_"
    assert env["PORTICO_GATEWAY_ADDR"] == "gateway:8000"
    assert any(v.endswith("/etc/nginx/templates/portico.conf.template:ro") for v in _volumes(nginx))


def test_every_mounted_repository_file_exists(resolved: dict[str, Any]) -> None:
    for service in resolved["services"].values():
        for volume in _volumes(service):
            source = volume.split(":", 1)[0]
            if source.startswith("/"):
                if source.endswith("/certs"):
                    continue  # made by make-dev-cert.sh or the operator, never committed
                assert Path(source).exists(), f"{source} is mounted but missing"


def test_compose_gateway_config_is_valid() -> None:
    from gateway.config import load_config

    config = load_config(COMPOSE_DIR / "portico.yaml")
    assert config.listen.host == "0.0.0.0" and config.listen.port == 8000
    assert config.redis.url is None  # it comes from PORTICO_REDIS_URL, with the password


def test_dockerfile_runs_unprivileged_with_a_healthcheck() -> None:
    text = (REPO_ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*", text, re.M)
    assert re.search(r'^CMD \["portico", "serve"', text, re.M)
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for part in source.split():
            assert (REPO_ROOT / part).exists(), f"Dockerfile copies missing {part}"


def test_dockerignore_keeps_secrets_and_the_venv_out_of_the_build() -> None:
    ignored = set((REPO_ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "deploy/compose/.env", "deploy/compose/certs"} <= ignored


def test_gateway_takes_redis_from_the_environment_as_compose_passes_it(
    tmp_path: Path, redis_url: str
) -> None:
    # compose keeps the Redis password out of portico.yaml: the URL arrives as
    # PORTICO_REDIS_URL. Every replica must then share that Redis, not an embedded one.
    import redis
    from gateway_process import GatewayProcess

    gateway = GatewayProcess(tmp_path, redis_url, redis_url_in_env=True)
    gateway.start()
    try:
        gateway.create_key("from-env")
        shared = redis.Redis.from_url(redis_url)
        assert shared.sismember("portico:tenants", "from-env")
    finally:
        gateway.stop()


def test_the_files_the_image_copies_build_a_complete_wheel(tmp_path: Path) -> None:
    # Exactly the build stage's COPY sources, nothing else from the checkout.
    import shutil
    import sys
    import zipfile

    text = (REPO_ROOT / "Dockerfile").read_text()
    build_stage = text.split("FROM ${PYTHON_IMAGE} AS build", 1)[1].split("\nFROM ", 1)[0]
    src = tmp_path / "src"
    src.mkdir()
    for line in re.findall(r"^COPY (?!--from)(.+) \S+$", build_stage, re.M):
        for part in line.split():
            origin = REPO_ROOT / part
            if origin.is_dir():  # as .dockerignore leaves them
                shutil.copytree(
                    origin, src / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
                )
            else:
                shutil.copy(origin, src / part)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("portico-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "portico/cli.py",
        "gateway/app.py",
        "gateway/admission/limiter.lua",
        "engine/server/cli.py",
        "policies/plans.yaml",
        "policies/routing.yaml",
        "policies/retry.yaml",
    } <= names
