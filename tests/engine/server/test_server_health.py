"""Liveness and readiness follow the real engine loop's state (in-process app, real engine)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.server.app import create_app, health_problem
from engine.server.settings import ServerSettings


async def test_health_and_ready_track_the_engine_loop(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine.from_config(
        EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB", max_model_len=128)
    )
    app = create_app(engine, ServerSettings(served_model_name="tiny"))
    transport = httpx.ASGITransport(app=app)  # runs no lifespan: the test drives the engine
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        assert (await client.get("/health")).status_code == 503  # loop not started
        assert (await client.get("/ready")).status_code == 503
        await engine.start()
        try:
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await client.get("/ready")).status_code == 200
            resp = await client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
            )
            assert resp.json()["usage"]["completion_tokens"] == 2
            app.state.drain.start_draining()
            ready = await client.get("/ready")
            assert ready.status_code == 503
            assert ready.json()["error"]["code"] == "not_ready"
            assert (await client.get("/health")).status_code == 200
            refused = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
            assert refused.status_code == 503
        finally:
            await engine.shutdown()
        dead = await client.get("/health")
        assert dead.status_code == 503
        assert "not running" in dead.json()["error"]["message"]


def test_a_loop_without_progress_while_work_is_pending_is_unhealthy() -> None:
    now = time.monotonic()
    loop = SimpleNamespace(is_alive=True, num_unfinished=3, last_progress=now - 120)
    assert "no progress" in (health_problem(loop, stall_timeout_s=60) or "")  # type: ignore[arg-type]
    loop.num_unfinished = 0  # idle is not stuck
    assert health_problem(loop, stall_timeout_s=60) is None  # type: ignore[arg-type]
    loop.num_unfinished, loop.last_progress = 3, now
    assert health_problem(loop, stall_timeout_s=60) is None  # type: ignore[arg-type]
