"""Prefix-cache isolation between tenants, through the real gateway and a real tiny engine.

The side channel (a published vLLM CVE in 2025): if tenant B's request for a prompt tenant A
already sent hits A's cached blocks, B's time to first token drops and B learns what A sent.
The engine's own report of the cached prompt tokens (``usage.prompt_tokens_details.
cached_tokens``) is what decides the time saved, so the tests assert on it: deterministic, no
clock. (``load/cache_timing.py`` measures the TTFT distributions themselves.)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.gateway.dataplane.harness import GatewayProcess, tiny_engine

pytestmark = pytest.mark.slow

ROUTING = {"tiers": [{"name": "small", "model": "tiny"}]}
CORP_PROMPT = "You are the assistant of Example Corp. " * 12  # the plan's shared prefix
PLANS = {
    "default_plan": "solo",
    "plans": {
        "solo": {"share_prefix_cache": False},
        "team": {"share_prefix_cache": True},
        "corp": {"share_prefix_cache": False, "shared_prefixes": [CORP_PROMPT]},
    },
}


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_server: Any, tiny_llama_dir: Path) -> Iterator[GatewayProcess]:
    plans = module_tmp / "plans.yaml"
    plans.write_text(yaml.safe_dump(PLANS))
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": redis_server.url, "plans_file": str(plans)},
            "engines": [tiny_engine(tiny_llama_dir, "tiny")],
        },
        ROUTING,
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def long_prompt() -> str:
    """About 400 tokens no other test sends (25 blocks of 16)."""
    words = uuid.uuid4().hex
    return " ".join(f"{words[i % 32]}{i} tale" for i in range(160))


def complete(gw: GatewayProcess, key: str, prompt: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        gw.base_url + "/v1/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra},
        timeout=120,
    )


def cached(gw: GatewayProcess, key: str, prompt: str, **extra: Any) -> int:
    r = complete(gw, key, prompt, **extra)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_non_string_cache_salt_is_a_400_naming_it(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant("solo")
    for salt in (5, ["x"], ""):
        r = httpx.post(
            gateway.base_url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "cache_salt": salt,
            },  # fmt: skip
            timeout=60,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"


def test_tenant_b_never_hits_what_tenant_a_cached(gateway: GatewayProcess) -> None:
    _, key_a = gateway.create_tenant("solo")
    _, key_b = gateway.create_tenant("solo")
    prompt = long_prompt()
    assert cached(gateway, key_a, prompt) == 0
    assert cached(gateway, key_a, prompt) >= 300  # A's own repeat hits
    assert cached(gateway, key_b, prompt) == 0  # B sees a miss: nothing to time
    assert cached(gateway, key_b, prompt) >= 300  # B's own repeat hits its own blocks
    assert cached(gateway, key_a, prompt) >= 300


def test_a_client_salt_narrows_within_its_tenant_only(gateway: GatewayProcess) -> None:
    _, key_a = gateway.create_tenant("solo")
    _, key_b = gateway.create_tenant("solo")
    prompt = long_prompt()
    assert cached(gateway, key_a, prompt) == 0
    # a client salt is a cache of its own, inside the tenant's
    assert cached(gateway, key_a, prompt, cache_salt="user-1") == 0
    assert cached(gateway, key_a, prompt, cache_salt="user-1") >= 300
    assert cached(gateway, key_a, prompt, cache_salt="user-2") == 0
    # another tenant naming the same client salt is still another tenant
    assert cached(gateway, key_b, prompt, cache_salt="user-1") == 0


def test_tenants_of_a_sharing_plan_hit_each_other(gateway: GatewayProcess) -> None:
    _, key_a = gateway.create_tenant("team")
    _, key_b = gateway.create_tenant("team")
    _, key_c = gateway.create_tenant("solo")
    prompt = long_prompt()
    assert cached(gateway, key_a, prompt) == 0
    assert cached(gateway, key_b, prompt) >= 300
    assert cached(gateway, key_c, prompt) == 0


def shared_tokens(prompt_ids: list[int], prefix_ids: list[int]) -> int:
    """What the engine caches under the plan's salt: the full blocks (16 tokens) of the
    prompt's common start with the prefix rendered alone."""
    common = 0
    for a, b in zip(prompt_ids, prefix_ids, strict=False):
        if a != b:
            break
        common += 1
    return common // 16 * 16


def test_a_plans_shared_prefix_is_shared_and_nothing_after_it(
    gateway: GatewayProcess, tiny_llama_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    _, key_a = gateway.create_tenant("corp")
    _, key_b = gateway.create_tenant("corp")
    _, key_solo = gateway.create_tenant("solo")
    prompt = CORP_PROMPT + long_prompt()
    expected = shared_tokens(tok.encode(prompt), tok.encode(CORP_PROMPT))
    assert expected >= 64  # the declared prefix is several blocks long
    assert cached(gateway, key_a, prompt) == 0
    assert cached(gateway, key_b, prompt) == expected  # B hits the declared prefix only
    assert cached(gateway, key_b, prompt) >= 300  # and then its own blocks
    assert cached(gateway, key_solo, prompt) == 0  # another plan: nothing
    # a chat whose system prompt starts with the declared prefix shares it too
    messages = [
        {"role": "system", "content": CORP_PROMPT + "Be brief."},
        {"role": "user", "content": long_prompt()},
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    alone = tok.apply_chat_template(
        [{"role": "system", "content": CORP_PROMPT}], add_generation_prompt=False, tokenize=False
    )
    expected = shared_tokens(
        tok.encode(rendered, add_special_tokens=False), tok.encode(alone, add_special_tokens=False)
    )
    assert expected >= 64
    hits = []
    for key in (key_a, key_b):
        r = httpx.post(
            gateway.base_url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": "tiny", "max_tokens": 1, "messages": messages},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        hits.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert hits == [0, expected]
