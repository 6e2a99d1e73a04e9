"""schemathesis over the OpenAPI documents of a real engine process and a real gateway process:
0 responses with a 5xx, 0 responses outside the document (status, content type, body schema)."""

from __future__ import annotations

import pytest

from tests.engine.server.engine_server_process import API_KEY, EngineProcess
from tests.gateway.dataplane.harness import ADMIN_KEY
from tests.hardening.conftest import HardenedGateway
from tests.hardening.contract import contract_failures

EXAMPLES_PER_OPERATION = 25  # per generation mode; bounded so the suite stays short


@pytest.fixture(scope="module")
def engine(hermes_engine_server: EngineProcess) -> EngineProcess:
    # With a tool-call parser, generated `tools` + `tool_choice: auto` bodies are valid requests
    # (vLLM's rule refuses auto without one), so more of the generated chats really generate.
    # The session's engine (tests/conftest.py), which must also exit 0 at the end.
    return hermes_engine_server


@pytest.mark.slow  # schemathesis drives real generations through every route: the longest run
def test_the_engine_keeps_its_openapi_document(engine: EngineProcess) -> None:
    failures, statuses = contract_failures(
        engine.base_url + "/openapi.json",
        base_url=engine.base_url,
        headers={"authorization": f"Bearer {API_KEY}"},
        max_examples=EXAMPLES_PER_OPERATION,
    )
    # Generation itself was exercised. The chat document is wide (tools, structured outputs,
    # every vLLM field), so a bounded run may draw only refused chats: either route counts.
    generated = statuses["POST /v1/chat/completions 200"] + statuses["POST /v1/completions 200"]
    assert generated > 0, dict(statuses)
    # The embeddings and Responses routes were served and refused bad input in OpenAI's shape
    # (a refusal outside the document, or a 5xx, would be among the failures).
    assert statuses["POST /v1/embeddings 200"] > 0, dict(statuses)
    assert statuses["POST /v1/embeddings 400"] > 0, dict(statuses)
    assert statuses["POST /v1/responses 400"] > 0, dict(statuses)
    assert not failures, "\n".join(failures)
    assert engine.proc.poll() is None, engine.logs()


@pytest.mark.slow  # schemathesis over every admin operation, each example a real request
def test_the_gateway_admin_api_keeps_its_openapi_document(
    hardened_gateway: HardenedGateway,
) -> None:
    failures, statuses = contract_failures(
        hardened_gateway.url + "/admin/v1/openapi.json",
        base_url=hardened_gateway.url,
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
        max_examples=EXAMPLES_PER_OPERATION,
    )
    assert statuses["POST /admin/v1/tenants 201"] > 0  # writes were exercised, not only refusals
    assert not failures, "\n".join(failures)
    assert hardened_gateway.process.proc is not None
    assert hardened_gateway.process.proc.poll() is None, hardened_gateway.process.log()
