"""Chat message shapes, generated: never a 500, and a malformed message or content part is a 400
naming its place (``messages[0].content[1].text``), from the real gateway and from the engine's
own request models alike.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.server.protocol import parse_body
from engine.server.protocol_chat import ChatCompletionRequest
from portico.errors import InvalidRequestError
from tests.hardening.conftest import MODEL, HardenedGateway
from tests.hardening.test_hostile_inputs import Tenant, assert_refusal_shape, tenant  # noqa: F401

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-1, 1) | st.text(max_size=6)
# a content part: well formed, or with any of its fields of any type, or not an object at all
parts = (
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)})
    | st.fixed_dictionaries({"type": st.just("text")}, optional={"text": scalars})
    | st.fixed_dictionaries(
        {"type": st.just("image_url")},
        optional={"image_url": scalars | st.fixed_dictionaries({}, optional={"url": scalars})},
    )
    | st.fixed_dictionaries({}, optional={"type": scalars, "text": scalars})
    | scalars
)
contents = scalars | st.lists(parts, max_size=3)
messages = (
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | scalars,
            "content": contents,
            "name": scalars,
        },
    )
    | scalars
)


def well_formed(message: Any) -> bool:
    """What the gateway must pass: a role, and content of the right shape where required."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    content = message.get("content")
    if content is None:
        return message["role"] == "assistant"
    if isinstance(content, str):
        return True
    if not isinstance(content, list):
        return False
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return False
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            return False
        if part["type"] == "image_url":
            image = part.get("image_url")
            if not isinstance(image, dict) or not isinstance(image.get("url"), str):
                return False
            # a data URL the gateway decodes, or an http(s) URL (never generated: too short)
            if not image["url"].startswith(("http://", "https://")):
                return False
    return True


TEXT_5 = [{"role": "user", "content": [{"type": "text", "text": 5}]}]  # was a 500
NO_CONTENT = [{"role": "system", "content": "s"}, {"role": "user"}]  # was a 200
FINE = [{"role": "user", "content": [{"type": "text", "text": "a"}]}, {"role": "assistant"}]


@PROPERTY
@given(turns=st.lists(messages, min_size=1, max_size=3))
@example(turns=TEXT_5)
@example(turns=NO_CONTENT)
@example(turns=FINE)
def test_generated_messages_never_get_a_5xx_and_a_bad_one_is_named(
    hardened_gateway: HardenedGateway,
    tenant: Tenant,  # noqa: F811
    turns: list[Any],
) -> None:
    body = {"model": MODEL, "messages": turns, "max_tokens": 2}
    r = httpx.post(
        hardened_gateway.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {tenant.key}"},
        timeout=30,
    )
    assert_refusal_shape(r)
    bad = next((i for i, m in enumerate(turns) if not well_formed(m)), None)
    if bad is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, (turns, r.text)
        assert r.json()["error"]["param"].startswith(f"messages[{bad}]"), r.text
    tenant.settle(r.status_code)


@PROPERTY
@given(turns=st.lists(messages, min_size=1, max_size=3))
@example(turns=TEXT_5)
@example(turns=NO_CONTENT)
def test_the_engine_refuses_any_bad_message_with_a_400_naming_it(turns: list[Any]) -> None:
    raw = json.dumps({"model": "m", "messages": turns}).encode()
    try:
        parse_body(ChatCompletionRequest, raw)
    except InvalidRequestError as exc:
        assert exc.param is not None and exc.param.startswith("messages"), exc.message
        return
    assert all(well_formed(m) for m in turns), turns
