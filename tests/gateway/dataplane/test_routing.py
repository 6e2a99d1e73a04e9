"""Router: explicit models, aliases, ``auto`` by complexity score, authorization."""

from __future__ import annotations

import json

import pytest

from gateway.body.fields import parse_fields
from gateway.identity.principal import Limits, Principal
from gateway.relay.routing import Router, RoutingPolicy
from portico.errors import NotFoundError, PermissionDeniedError

POLICY = RoutingPolicy.model_validate(
    {
        "aliases": {"fast": "small-model"},
        "tiers": [
            {"name": "small", "model": "small-model", "max_score": 1.0},
            {"name": "medium", "model": "medium-model", "max_score": 3.0},
            {"name": "large", "model": "remote-model"},
        ],
        "weights": {
            "prompt_tokens": 0.001,
            "max_tokens": 0.001,
            "turns": 0.1,
            "code_blocks": 1.0,
            "tools": 1.0,
            "keywords": 1.0,
        },
        "keywords": ["prove", "step by step"],
    }
)
MODELS = {"small-model", "medium-model", "remote-model"}


def principal(allowed: set[str] | None = None) -> Principal:
    return Principal(
        tenant_id="acme",
        plan="p",
        limits=Limits(),
        allowed_models=frozenset(allowed) if allowed is not None else None,
    )


def chat(model: str, content: str, **extra: object):  # type: ignore[no-untyped-def]
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": content},
        ],
        **extra,
    }
    return parse_fields(json.dumps(body).encode(), "chat")


def test_explicit_model_and_alias_route_directly() -> None:
    router = Router(POLICY, MODELS)
    d = router.route(chat("medium-model", "hi"), principal())
    assert (d.tier, d.model, d.reason) == ("direct", "medium-model", "explicit")
    d = router.route(chat("fast", "hi"), principal())
    assert (d.model, d.reason) == ("small-model", "alias:fast")
    assert d.header.startswith("tier=direct; model=small-model; reason=alias:fast")


def test_auto_short_prompt_takes_the_small_tier() -> None:
    d = Router(POLICY, MODELS).route(chat("auto", "hello", max_tokens=50), principal())
    assert (d.tier, d.model) == ("small", "small-model")
    assert d.reason.startswith("auto score=")


def test_auto_code_and_keywords_climb_tiers() -> None:
    router = Router(POLICY, MODELS)
    code = "fix this:\n```python\nprint(1)\n```\n"
    assert router.route(chat("auto", code + "prove it"), principal()).tier == "medium"
    d = router.route(chat("auto", code * 3 + "prove it step by step", max_tokens=2000), principal())
    assert (d.tier, d.model) == ("large", "remote-model")
    f = router.features(chat("auto", code * 3 + "prove it step by step", max_tokens=2000))
    assert (f.code_blocks, f.keywords, f.max_tokens, f.turns) == (3, 2, 2000, 1)


def test_auto_counts_tools_and_turns() -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)]
    fields = chat("auto", "call it", tools=tools)
    assert Router(POLICY, MODELS).features(fields).tools == 2
    assert Router(POLICY, MODELS).route(fields, principal()).tier == "medium"


def test_auto_skips_tiers_the_plan_does_not_allow() -> None:
    d = Router(POLICY, MODELS).route(chat("auto", "hi"), principal({"medium-model"}))
    assert d.model == "medium-model"
    with pytest.raises(PermissionDeniedError):
        Router(POLICY, MODELS).route(chat("auto", "hi"), principal({"other"}))


def test_unknown_model_is_404_and_forbidden_model_is_403() -> None:
    router = Router(POLICY, MODELS)
    with pytest.raises(NotFoundError) as exc:
        router.route(chat("nope", "hi"), principal())
    assert exc.value.status_code == 404 and exc.value.param == "model"
    with pytest.raises(PermissionDeniedError) as denied:
        router.route(chat("medium-model", "hi"), principal({"small-model"}))
    assert denied.value.status_code == 403


def test_model_cards_list_each_allowed_model_once_with_its_aliases() -> None:
    router = Router(POLICY, MODELS)
    cards = router.model_cards(principal({"small-model"}))
    assert [(c["id"], c.get("aliases"), c.get("routes_to")) for c in cards] == [
        ("small-model", ["fast"], None),
        ("auto", None, ["small-model"]),
    ]
    assert router.model_cards(principal({"x"})) == []
    # a plan naming only the alias sees the alias, marked with the model it names
    only_alias = router.model_cards(principal({"fast"}))
    assert [(c["id"], c.get("alias_of")) for c in only_alias] == [("fast", "small-model")]
    assert router.find_card("fast", principal({"small-model"}))["alias_of"] == "small-model"  # type: ignore[index]
    assert router.find_card("medium-model", principal({"small-model"})) is None


def test_prefix_key_is_the_system_prompt_start() -> None:
    router = Router(POLICY, MODELS)
    a = router.route(chat("fast", "question one"), principal()).prefix_key
    b = router.route(chat("fast", "question two"), principal()).prefix_key
    assert a == b == b"be brief"


def test_policy_naming_an_unserved_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="not served"):
        Router(POLICY, {"small-model"})


def test_lenient_router_drops_tiers_of_models_not_served() -> None:
    router = Router(POLICY, {"small-model"}, strict=False)
    assert [t.name for t in router.policy.tiers] == ["small"]
    assert router.policy.aliases == {"fast": "small-model"}


FALLBACK_POLICY = {
    "tiers": [
        {
            "name": "small",
            "model": "small-model",
            "max_score": 1.0,
            "fallbacks": ["large", "medium"],
        },
        {"name": "medium", "model": "medium-model", "latency_budget_s": 2.0},
        {
            "name": "large",
            "model": "remote-model",
            "latency_budget_s": 0.5,
            "fallbacks": ["medium"],
        },
    ]
}


def test_a_decision_carries_its_fallback_tiers_in_order_and_falls_back() -> None:
    router = Router(RoutingPolicy.model_validate(FALLBACK_POLICY), MODELS)
    decision = router.route(chat("auto", "hi"), principal())
    assert decision.tier == "small" and [t.name for t in decision.fallbacks] == ["large", "medium"]
    nxt = decision.fall_back("no_healthy_replica")
    assert (nxt.tier, nxt.model, nxt.latency_budget_s) == ("large", "remote-model", 0.5)
    assert nxt.header.endswith("; fallback from small (no_healthy_replica)")
    last = nxt.fall_back("latency_budget")
    assert last.tier == "medium" and last.fallbacks == ()
    assert "fallback from small (no_healthy_replica); fallback from large (latency_budget)" in (
        last.reason
    )


def test_fallbacks_skip_tiers_the_plan_does_not_allow() -> None:
    router = Router(RoutingPolicy.model_validate(FALLBACK_POLICY), MODELS)
    decision = router.route(chat("auto", "hi"), principal({"small-model", "medium-model"}))
    assert [t.name for t in decision.fallbacks] == ["medium"]


def test_fallbacks_must_name_other_tiers() -> None:
    for bad in (["nope"], ["small"]):
        policy = {"tiers": [{"name": "small", "model": "small-model", "fallbacks": bad}]}
        with pytest.raises(ValueError, match="fallbacks name no other tier"):
            RoutingPolicy.model_validate(policy)
