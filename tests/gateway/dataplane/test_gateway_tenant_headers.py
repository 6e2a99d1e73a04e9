"""The engine hop's tenant headers, end to end: ``portico serve`` in front of a real tiny engine
and a real (in-test) OpenAI-compatible remote that records every header it receives.

Proves: the engine charges the authenticated tenant even when the client sends its own
``x-portico-*`` headers naming another tenant (read back from the engine's per-tenant
metrics, through the admin engines view the console shows); a remote provider never receives
any ``x-portico-*`` header; the headers a local engine gets carry the tenant's plan fields and
a remote's carry none; the tenant view shows the plan's share; and ``engine.scheduling``
reaches the engine's command line as ``--scheduling-policy``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server.cli import add_arguments as add_engine_arguments
from gateway.config import EngineSpec
from gateway.fleet.engine_admin import engine_gauges, tenant_rows
from gateway.fleet.pool import Pool
from gateway.identity.plans import load_plans
from gateway.identity.principal import EngineShare, Limits, Principal
from gateway.lifecycle import _engine_command
from gateway.metrics import GatewayMetrics
from gateway.relay.engine_hop import ENGINE_HOP_HEADERS, engine_hop_headers
from gateway.relay.proxy import LocalUpstream
from gateway.relay.retry import RetryPolicy
from gateway.remotes.openai_remote import OpenAIRemoteUpstream
from gateway.remotes.remote import RemoteSpec
from tests.gateway.dataplane.harness import ADMIN_KEY, GatewayProcess, tiny_engine

FORGED = {
    "x-portico-tenant": "victim",
    "x-portico-tenant-weight": "1000000",
    "x-portico-priority-class": "batch",
    "x-portico-kv-share": "0.01",
}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


class _Recorder(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint that keeps every request's headers."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.seen.append({k.lower(): v for k, v in self.headers.items()})  # type: ignore[attr-defined]
        body = json.dumps(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "recorder",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def recorder() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def gateway(
    module_tmp: Path, tiny_llama_dir: Path, recorder: ThreadingHTTPServer
) -> Iterator[GatewayProcess]:
    port = recorder.server_address[1]
    gw = GatewayProcess(
        module_tmp,
        {
            "engines": [tiny_engine(tiny_llama_dir, "tiny")],
            "engine": {"scheduling": "fcfs"},
            "remotes": [
                {
                    "name": "recorder",
                    "model": "openai/recorder",
                    "api_base": f"http://127.0.0.1:{port}/v1",
                    "api_key_env": "HOME",
                }
            ],
        },
        routing={},
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def _engines(gateway: GatewayProcess) -> list[dict[str, Any]]:
    resp = httpx.get(gateway.base_url + "/admin/v1/engines", headers=ADMIN, timeout=30)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["data"])


def test_engine_charges_the_authenticated_tenant_not_the_clients_header(
    gateway: GatewayProcess,
) -> None:
    tenant_id, key = gateway.create_tenant("standard")
    client = openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=120
    )
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Who am I?"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
        extra_headers=FORGED,
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 6

    (engine,) = _engines(gateway)
    rows = {row["tenant"]: row for row in engine["tenants"]}
    assert "victim" not in rows  # the forged header never reached the engine
    mine = rows[tenant_id]
    # the engine counts tokens as it schedules them: the whole prompt, and the decode steps
    assert mine["prompt_tokens"] >= reply.usage.prompt_tokens
    assert mine["generation_tokens"] >= reply.usage.completion_tokens - 1 > 0
    assert mine["running"] == mine["waiting"] == 0  # finished: nothing left on the engine


def test_a_remote_provider_never_receives_tenant_headers(
    gateway: GatewayProcess, recorder: ThreadingHTTPServer
) -> None:
    _, key = gateway.create_tenant("standard")
    seen: list[dict[str, str]] = recorder.seen  # type: ignore[attr-defined]
    before = len(seen)
    resp = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}", **FORGED},
        json={"model": "recorder", "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "ok"
    (headers,) = seen[before:]
    # the remote's configured key (api_key_env: HOME) replaced the client's
    assert headers["authorization"] == f"Bearer {os.environ['HOME']}"
    assert not [name for name in headers if name.startswith("x-portico-")]


def test_tenant_view_shows_its_plans_engine_share(gateway: GatewayProcess) -> None:
    tenant_id, _ = gateway.create_tenant("enterprise")
    resp = httpx.get(gateway.base_url + f"/admin/v1/tenants/{tenant_id}", headers=ADMIN)
    assert resp.status_code == 200, resp.text
    plan = load_plans()["enterprise"]
    assert resp.json()["effective"]["engine_share"] == {
        "weight": plan.weight,
        "priority_class": plan.priority_class,
        "kv_share": plan.kv_share,
        "max_running": plan.max_running,
    }


def test_engine_scheduling_reaches_the_engines_command_line(gateway: GatewayProcess) -> None:
    (engine,) = _engines(gateway)
    argv = Path(f"/proc/{engine['pid']}/cmdline").read_bytes().split(b"\0")
    at = argv.index(b"--scheduling-policy")
    assert argv[at + 1] == b"fcfs" and argv.count(b"--scheduling-policy") == 1


# ------------------------------------------------------------------ the headers themselves


def _principal(share: EngineShare) -> Principal:
    return Principal(tenant_id="acme", plan="p", limits=Limits(), share=share)


def test_local_engines_get_the_plan_share_and_remotes_get_none() -> None:
    share = EngineShare(weight=2.5, priority_class="batch", kv_share=0.25, max_running=3)
    principal = _principal(share)
    assert engine_hop_headers(principal) == {
        "x-portico-tenant": "acme",
        "x-portico-tenant-weight": "2.5",
        "x-portico-priority-class": "batch",
        "x-portico-kv-share": "0.25",
        "x-portico-max-running": "3",
    }
    metrics = GatewayMetrics()
    local = LocalUpstream(Pool("tiny", []), RetryPolicy(), metrics)
    sent = local.request_headers("req-1", None, principal)
    assert {k: sent[k] for k in ENGINE_HOP_HEADERS} == engine_hop_headers(principal)
    assert local.request_headers("req-1", None) == {
        "content-type": "application/json",
        "x-request-id": "req-1",
    }  # nobody to name: no tenant headers at all

    spec = RemoteSpec(
        name="r", model="openai/r", api_base="http://127.0.0.1:9/v1", api_key_env="R_KEY"
    )
    remote = OpenAIRemoteUpstream(spec, RetryPolicy(), metrics, {"R_KEY": "sk-x"})
    sent = remote.request_headers("req-1", None, principal)
    assert sent["authorization"] == "Bearer sk-x"
    assert not [name for name in sent if name.startswith("x-portico-")]


def test_packaged_plans_carry_valid_shares() -> None:
    plans = load_plans()
    for plan in plans.values():
        share = plan.engine_share()
        assert share.weight > 0 and 0 < share.kv_share <= 1
        assert share.priority_class in ("interactive", "batch") and share.max_running >= 0
    assert plans["enterprise"].weight > plans["standard"].weight > plans["free"].weight
    assert EngineSpec().command is None  # the default engine is ours: it gets the flag


def test_engine_command_carries_the_scheduling_policy_unless_the_engine_says_otherwise() -> None:
    uds = Path("/run/x.sock")
    ours = _engine_command(EngineSpec(), "smollm2-0", uds, "fair")
    assert ours[ours.index("--scheduling-policy") + 1] == "fair"
    # the spec's own flag comes later on the line, and the engine's parser keeps the last
    own = _engine_command(
        EngineSpec(args=["--scheduling-policy", "fcfs"]), "smollm2-0", uds, "fair"
    )
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)  # the engine's own command-line parser
    assert parser.parse_args(own[own.index("engine") + 1 :]).scheduling_policy == "fcfs"
    # another server's command line is left alone
    other = _engine_command(EngineSpec(command=["srv", "--uds", "{uds}"]), "x-0", uds, "fair")
    assert other == ["srv", "--uds", str(uds)]


def test_tenant_rows_split_tokens_by_kind_and_put_the_biggest_holder_first() -> None:
    text = """# HELP portico_engine_tenant_tokens_total Tokens scheduled per tenant.
# TYPE portico_engine_tenant_tokens_total counter
portico_engine_tenant_tokens_total{kind="prompt",model_name="m",tenant="a"} 10.0
portico_engine_tenant_tokens_total{kind="generation",model_name="m",tenant="a"} 5.0
portico_engine_tenant_tokens_total{kind="generation",model_name="m",tenant="b"} 7.0
portico_engine_tenant_tokens_created{kind="prompt",model_name="m",tenant="a"} 1.7e9
# HELP portico_engine_tenant_kv_blocks KV blocks held per tenant.
# TYPE portico_engine_tenant_kv_blocks gauge
portico_engine_tenant_kv_blocks{model_name="m",tenant="b"} 3.0
# HELP portico_engine_tenant_requests_waiting Requests waiting per tenant.
# TYPE portico_engine_tenant_requests_waiting gauge
portico_engine_tenant_requests_waiting{model_name="m",tenant="a"} 2.0
# HELP portico_engine_tenant_slot_share Running slots owed per tenant.
# TYPE portico_engine_tenant_slot_share gauge
portico_engine_tenant_slot_share{model_name="m",tenant="a"} 8.0
# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
"""
    families = list(text_string_to_metric_families(text))
    empty = dict.fromkeys(
        ("prompt_tokens", "generation_tokens", "running", "waiting", "slot_share"), 0
    )
    assert tenant_rows(families) == [
        {"tenant": "b", **empty, "generation_tokens": 7, "kv_blocks": 3},
        {"tenant": "a", **empty, "prompt_tokens": 10, "generation_tokens": 5, "waiting": 2,
         "kv_blocks": 0, "slot_share": 8},
    ]  # fmt: skip
    assert engine_gauges(families) == {"running": 1.0}
