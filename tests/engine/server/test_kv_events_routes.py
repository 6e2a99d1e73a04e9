"""GET /v1/kv_events and /v1/kv_events/snapshot on a real tiny engine (in-process app): the
hashes a served request stores are the ones a router computes from its tokens and salt."""

from __future__ import annotations

from pathlib import Path

import httpx

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.server.app import create_app
from engine.server.settings import ServerSettings
from portico.contract import prefix_block_hashes


async def test_served_prompt_blocks_appear_as_events_a_router_can_match(
    tiny_llama_dir: Path,
) -> None:
    engine = AsyncLLMEngine.from_config(
        EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB", max_model_len=128)
    )
    app = create_app(engine, ServerSettings(served_model_name="tiny"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        await engine.start()
        try:
            empty = (await client.get("/v1/kv_events/snapshot")).json()
            assert empty["hashes"] == [] and empty["next_seq"] == 1
            block_size = empty["block_size"]
            prompt = list(range(5, 5 + 3 * block_size + 2))  # 3 full blocks
            resp = await client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": "t1"},
            )
            assert resp.status_code == 200
            root = bytes.fromhex(empty["hash_root"])
            expected = [h.hex() for h in prefix_block_hashes(root, prompt, block_size, "t1")]
            polled = (await client.get("/v1/kv_events", params={"since": 1})).json()
            assert polled["epoch"] == empty["epoch"] and not polled["resync"]
            assert polled["num_waiting"] == 0 and 0 <= polled["kv_cache_usage"] <= 1
            stored = [h for e in polled["events"] if e["type"] == "stored" for h in e["hashes"]]
            assert stored[:3] == expected
            snap = (await client.get("/v1/kv_events/snapshot")).json()
            assert set(expected) <= set(snap["hashes"])
            assert snap["next_seq"] == polled["next_seq"]
            # a poll from a sequence number this engine never issued: resync from a snapshot
            ahead = await client.get("/v1/kv_events", params={"since": 10**6})
            assert ahead.json()["resync"] is True and ahead.json()["events"] == []
            bad = await client.get("/v1/kv_events", params={"since": "x"})
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "since"
            assert (await client.get("/v1/kv_events", params={"limit": 0})).status_code == 400
        finally:
            await engine.shutdown()
