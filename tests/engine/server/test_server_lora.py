"""Adapters through a real `portico engine` process and the real `openai` client: listed
under their base model, chosen by ``model``, loaded and unloaded at runtime under traffic
without losing a request, refused with a 400 that says why, and counted in vLLM's metric."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from engine_server_process import API_KEY, MODEL_NAME, EngineProcess
from lora_adapters import make_adapter, merged_greedy
from prometheus_client.parser import text_string_to_metric_families

MAX_TOKENS = 8
PROMPT = [1, 450, 7483, 310, 3444, 338]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def hf_base(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def adapters(hf_base, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_adapter(hf_base, root / "sql", rank=8, targets=ATTN, seed=1),
        "code": make_adapter(hf_base, root / "code", rank=4, targets=["down_proj"], seed=2),
        "late": make_adapter(hf_base, root / "late", rank=2, targets=["v_proj"], seed=3),
        "big": make_adapter(hf_base, root / "big", rank=32, targets=["q_proj"], seed=4),
    }


@pytest.fixture(scope="module")
def expected(hf_base, adapters, tiny_llama_dir: Path) -> dict[str, str]:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    out = {MODEL_NAME: merged_greedy(hf_base, None, PROMPT, MAX_TOKENS)}
    for name in ("sql", "code", "late"):
        out[name] = merged_greedy(hf_base, adapters[name], PROMPT, MAX_TOKENS)
    return {k: tok.decode(v, skip_special_tokens=True) for k, v in out.items()}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, adapters, tmp_path_factory) -> Iterator[EngineProcess]:  # type: ignore[no-untyped-def]
    logs = tmp_path_factory.mktemp("lora-engine-logs")
    extra = [
        "--enable-lora", "--max-loras", "3", "--max-lora-rank", "16",
        "--allow-runtime-lora-updating",
        "--lora-modules", f"sql={adapters['sql']}",
        f'{{"name": "code", "path": "{adapters["code"]}", "base_model_name": "{MODEL_NAME}"}}',
    ]  # fmt: skip
    proc = EngineProcess(tiny_llama_dir, logs / "engine.log", extra=extra)
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, proc.logs()


def client(server: EngineProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


async def complete(c: openai.AsyncOpenAI, model: str) -> str:
    resp = await c.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.usage is not None and resp.usage.completion_tokens == MAX_TOKENS
    return resp.choices[0].text


def test_models_lists_each_adapter_with_its_parent(server: EngineProcess) -> None:
    with server.client() as http:
        data = http.get("/v1/models").json()["data"]
    parents = {m["id"]: m["parent"] for m in data}
    assert parents == {MODEL_NAME: None, "sql": MODEL_NAME, "code": MODEL_NAME}


def test_requests_name_the_adapter_as_model_and_mix_in_one_batch(server, expected) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[str]:
        c = client(server)
        names = [MODEL_NAME, "sql", "code"] * 3
        return await asyncio.gather(*(complete(c, n) for n in names))

    got = asyncio.run(main())
    assert got == [expected[n] for n in [MODEL_NAME, "sql", "code"] * 3]
    assert expected["sql"] != expected[MODEL_NAME] != expected["code"]


def test_unknown_model_is_404_model_not_found(server: EngineProcess) -> None:
    with server.client() as http:
        r = http.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_runtime_load_refuses_bad_adapters_with_400(server, adapters, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with server.client() as http:
        r = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapters["big"])}
        )
        assert r.status_code == 400
        assert "rank 32 exceeds --max-lora-rank 16" in r.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "never"})
        assert r.status_code == 404
        ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert "big" not in ids and "x" not in ids  # nothing left behind


async def stream_after_first_chunk(c: openai.AsyncOpenAI, model: str):  # type: ignore[no-untyped-def]
    """Start a streamed completion and return (first text, the rest of the stream) once its
    first token has arrived: from then on the request is running in the engine."""
    stream = await c.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    iterator = stream.__aiter__()
    first = await iterator.__anext__()
    return first.choices[0].text, iterator


async def rest_of(first: str, iterator) -> str:  # type: ignore[no-untyped-def]
    return first + "".join([chunk.choices[0].text async for chunk in iterator if chunk.choices])


def test_runtime_load_and_unload_under_traffic_lose_no_request(server, adapters, expected) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        c = client(server)
        async with server.async_client() as http:
            r = await http.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "late", "lora_path": str(adapters["late"])},
            )
            assert r.status_code == 200, r.text
            # Requests on every model are running when "late" is unloaded and "sql" is
            # unloaded and loaded again.
            names = ["late", MODEL_NAME, "sql", "code"] * 3
            started = await asyncio.gather(*(stream_after_first_chunk(c, n) for n in names))
            r1 = await http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
            r2 = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            more = asyncio.gather(*(complete(c, n) for n in (MODEL_NAME, "code")))
            r3 = await http.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "sql", "lora_path": str(adapters["sql"])},
            )
            assert [r1.status_code, r2.status_code, r3.status_code] == [200, 200, 200]
            got = await asyncio.gather(*(rest_of(first, it) for first, it in started))
            # Every running request finished with its own adapter's output.
            assert got == [expected[n] for n in names]
            assert await more == [expected[MODEL_NAME], expected["code"]]
            with pytest.raises(openai.NotFoundError):
                await complete(c, "late")
            assert await complete(c, "sql") == expected["sql"]
            ids = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
            assert "late" not in ids and "sql" in ids

    asyncio.run(main())


def test_lora_requests_info_metric(server: EngineProcess) -> None:
    with server.client() as http:
        text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    info = families["vllm:lora_requests_info"]
    (sample,) = info.samples
    assert sample.labels["max_lora"] == "3"
    assert set(sample.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}


def test_kv_events_name_the_adapters_and_a_router_matches_an_adapters_blocks(
    server: EngineProcess,
) -> None:
    """The poll a gateway's prefix index reads names each adapter with this engine's number
    for it and those in a slot; with them the router hashes an adapter's prompt as the engine
    did (the number is inside the block hash: the base model's blocks differ)."""
    from gateway.fleet.prefix_index import PrefixIndex, RouteTokens

    prompt = PROMPT * 6  # 36 tokens: two full blocks

    async def run() -> None:
        c = client(server)
        await c.completions.create(model="sql", prompt=prompt, max_tokens=1)

    asyncio.run(run())
    index = PrefixIndex()
    with server.client() as http:
        index.apply_snapshot("r", http.get("/v1/kv_events/snapshot").json())
        doc = http.get("/v1/kv_events", params={"since": index.entries["r"].next_seq}).json()
    assert index.apply_events("r", doc)
    assert {"sql", "code"} <= set(doc["lora_adapters"])
    assert doc["lora_adapters"]["sql"] != doc["lora_adapters"]["code"]
    assert "sql" in doc["lora_resident"]
    block_size = index.entries["r"].block_size
    full = len(prompt) // block_size * block_size
    assert index.cached_tokens("r", RouteTokens(prompt, model="sql")) == full > 0
    assert index.cached_tokens("r", RouteTokens(prompt, model="code")) == 0
    assert index.cached_tokens("r", RouteTokens(prompt, model=MODEL_NAME)) == 0
