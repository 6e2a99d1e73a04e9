"""LoRA adapters as tenant-scoped models, end to end: a real ``portico serve`` supervising a
real engine (tiny Llama, ``--enable-lora``), real Redis, the real ``openai`` client.

The admin registers a shared adapter and one private to tenant A; the gateway loads them into
the engine at runtime. Tenant A gets its adapter's own output (the adapter merged into the
weights with peft, greedy); tenant B cannot tell the private adapter exists (the same 404 as
for a model that never existed, by name, alias or ``auto``); usage is recorded per adapter; a
refused adapter leaves nothing behind; removal unloads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from lora_adapters import make_adapter, merged_greedy

from tests.gateway.dataplane.harness import ADMIN_KEY, GatewayProcess, tiny_engine, wait_until

pytestmark = pytest.mark.slow

PROMPT = [1, 450, 7483, 310, 3444, 338]
MAX_TOKENS = 8
ROUTING = {"tiers": [{"name": "small", "model": "tiny"}], "aliases": {"fast": "tiny"}}


@pytest.fixture(scope="module")
def hf_base(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def adapters(hf_base, module_tmp: Path) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return {
        "shared": make_adapter(hf_base, module_tmp / "shared", rank=8, targets=attn, seed=11),
        "private": make_adapter(
            hf_base, module_tmp / "private", rank=4, targets=["up_proj"], seed=12
        ),
        "big": make_adapter(hf_base, module_tmp / "big", rank=32, targets=["q_proj"], seed=13),
    }


@pytest.fixture(scope="module")
def expected(hf_base, adapters, tiny_llama_dir: Path) -> dict[str, str]:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    out = {"tiny": merged_greedy(hf_base, None, PROMPT, MAX_TOKENS)}
    for name in ("shared", "private"):
        out[name] = merged_greedy(hf_base, adapters[name], PROMPT, MAX_TOKENS)
    return {k: tok.decode(v, skip_special_tokens=True) for k, v in out.items()}


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_server, tiny_llama_dir: Path) -> Iterator[GatewayProcess]:  # type: ignore[no-untyped-def]
    engine = tiny_engine(tiny_llama_dir, "tiny")
    engine["args"] += ["--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating"]
    gw = GatewayProcess(
        module_tmp, {"redis": {"url": redis_server.url}, "engines": [engine]}, ROUTING
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def admin(gateway: GatewayProcess) -> httpx.Client:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.Client(base_url=gateway.base_url, headers=headers, timeout=120)


def complete(gateway: GatewayProcess, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(gateway.base_url + "/v1/completions", json=body, headers=headers, timeout=120)


def test_adapters_are_tenant_scoped_models(gateway: GatewayProcess, adapters, expected) -> None:  # type: ignore[no-untyped-def]
    tenant_a, key_a = gateway.create_tenant("standard")
    _, key_b = gateway.create_tenant("standard")
    with admin(gateway) as client:
        r = client.post("/admin/v1/adapters", json={"name": "shared", "base_model": "tiny",
                                                    "path": str(adapters["shared"])})  # fmt: skip
        assert r.status_code == 201, r.text
        r = client.post("/admin/v1/adapters", json={"name": "private", "base_model": "tiny",
                        "path": str(adapters["private"]), "tenant_id": tenant_a})  # fmt: skip
        assert r.status_code == 201, r.text
        # The engine refuses rank 32 (> --max-lora-rank 16): a 400 that says so, nothing kept.
        r = client.post("/admin/v1/adapters", json={"name": "big", "base_model": "tiny",
                                                    "path": str(adapters["big"])})  # fmt: skip
        assert r.status_code == 400 and "max-lora-rank" in r.json()["error"]["message"]
        listed = {a["name"]: a for a in client.get("/admin/v1/adapters").json()["data"]}
        assert sorted(listed) == ["private", "shared"]
        assert listed["private"]["loaded_on"] == ["tiny-0"]

    a = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key_a, max_retries=0)
    b = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key_b, max_retries=0)
    models_a = {m.id: getattr(m, "parent", None) for m in a.models.list()}
    models_b = {m.id: getattr(m, "parent", None) for m in b.models.list()}
    assert models_a["private"] == "tiny" and models_a["shared"] == "tiny"
    assert "private" not in models_b and models_b["shared"] == "tiny"

    for key, name in ((key_a, "private"), (key_a, "shared"), (key_b, "shared"), (key_b, "tiny")):
        r = complete(gateway, key, name)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[name], name
    assert expected["private"] != expected["tiny"] != expected["shared"]

    # Tenant B: the private adapter answers exactly like a model that does not exist.
    hidden = complete(gateway, key_b, "private")
    missing = complete(gateway, key_b, "nothing-here")
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json()["error"]["code"] == "model_not_found"
    assert hidden.json() == {
        "error": {**missing.json()["error"], "message": missing.json()["error"]["message"]
                  .replace("nothing-here", "private")}
    }  # fmt: skip
    # Alias and auto reach the base model, never someone's adapter.
    for name in ("fast", "auto"):
        r = complete(gateway, key_b, name)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["tiny"]

    # Usage is recorded per adapter, like per model (batched writes: wait for them).
    def usage_models() -> set[str]:
        with admin(gateway) as client:
            body = client.get(f"/admin/v1/tenants/{tenant_a}/usage").json()
        return set(str(body).split("'")) & {"private", "shared"}

    assert wait_until(lambda: usage_models() == {"private", "shared"}, timeout=30)

    # Removal: unloaded, and tenant A now gets the 404 too.
    with admin(gateway) as client:
        assert client.delete("/admin/v1/adapters/private").status_code == 200
        assert client.delete("/admin/v1/adapters/private").status_code == 404
        # The audit log has the two registrations and the removal (not the refused one).
        entries = client.get("/admin/v1/audit", params={"action": "adapter."}).json()["data"]
        assert [(e["action"], e["target"]) for e in entries] == [
            ("adapter.delete", "adapter:private"),
            ("adapter.create", "adapter:private"),
            ("adapter.create", "adapter:shared"),
        ]
        assert entries[0]["tenant_id"] == tenant_a and entries[0]["before"]["base_model"] == "tiny"
    assert complete(gateway, key_a, "private").status_code == 404
    assert complete(gateway, key_a, "shared").json()["choices"][0]["text"] == expected["shared"]
