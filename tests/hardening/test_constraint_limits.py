"""A hostile tenant's constraints against a real engine server: one tenant's grammar never stalls
the engine (issue 31).

Each reported fault has its test (each hung or answered 200 before the limits): a 1.5 MB JSON
schema, a regex with nested quantifiers, an exploding repeat. Then hypothesis generates schemas,
regexes, grammars and tool lists, and each answer must be a 4xx in OpenAI's shape or a result,
never a 5xx and never a hang; and a plain request is answered while an attack runs.

The "hang" detector is the client's generous timeout, not a latency bound. The engine is the
session's shared Hermes engine (tools with ``auto`` are valid there), with the default limits.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HANG_S = 120.0  # the client's timeout: a request this slow counts as a hang
PROPERTY = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def client(hermes_engine_server: Any) -> Iterator[httpx.Client]:
    with hermes_engine_server.client() as c:  # its timeout (120 s) is the hang detector
        yield c


def chat(client: httpx.Client, tenant: str = "attacker", **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(fields)
    return client.post("/v1/chat/completions", json=body, headers={"x-portico-tenant": tenant})


def assert_refused(r: httpx.Response, param: str, *flags: str) -> None:
    """A 400 in OpenAI's shape naming ``param`` and one of the limits ``flags``."""
    assert r.status_code == 400, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    named = [f for f in flags if f"--structured-outputs-{f})" in error["message"]]
    assert named, error["message"]


def wide_schema(num_properties: int) -> dict[str, Any]:
    props = {f"p{i}": {"type": "string", "description": "x" * 20} for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props)}


# ----------------------------------------------------------------------------- the reported faults


def test_a_1_5_mb_json_schema_is_a_400_naming_a_limit(client: httpx.Client) -> None:
    """Before the limits it compiled for about two minutes (then a 200)."""
    schema = wide_schema(20_000)  # the first limit its walk passes is the property count
    assert len(json.dumps(schema)) > 1_500_000
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    r = chat(client, response_format=fmt)
    assert_refused(r, "response_format.json_schema.schema", "max-properties", "max-bytes")
    long = {
        "type": "object",
        "properties": {f"p{i}": {"description": "x" * 3000} for i in range(500)},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "long", "schema": long}}
    assert_refused(
        chat(client, response_format=fmt), "response_format.json_schema.schema", "max-bytes"
    )


@pytest.mark.parametrize("pattern", ["(a+)+b", "(a*)*b", "(\\w+\\s?)+$"])
def test_a_nested_quantifier_regex_is_a_400_naming_the_repeat_limit(
    client: httpx.Client, pattern: str
) -> None:
    r = chat(client, structured_outputs={"regex": pattern}, max_tokens=64)
    assert_refused(r, "structured_outputs.regex", "max-repeat")
    assert "nested quantifiers" in r.json()["error"]["message"]


@pytest.mark.parametrize("pattern", ["a{1000}{1000}", "(a{1000}){1000}", "(.{1000}){1000}"])
def test_an_exploding_repeat_regex_is_a_400_naming_the_repeat_limit(
    client: httpx.Client, pattern: str
) -> None:
    r = chat(client, structured_outputs={"regex": pattern})
    assert_refused(r, "structured_outputs.regex", "max-repeat")


def test_too_many_tools_or_too_large_ones_are_a_400(client: httpx.Client) -> None:
    def tool(i: int, description: str = "") -> dict[str, Any]:
        fn = {"name": f"f{i}", "description": description, "parameters": {"type": "object"}}
        return {"type": "function", "function": fn}

    assert_refused(chat(client, tools=[tool(i) for i in range(129)]), "tools", "max-tools")
    big = [tool(i, "x" * 100_000) for i in range(6)]
    assert_refused(chat(client, tools=big), "tools", "max-tools-bytes")


def test_a_tool_schema_over_a_limit_is_a_400_naming_tools(client: httpx.Client) -> None:
    params = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(a+)+"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    r = chat(client, tools=tools, tool_choice="required")
    assert_refused(r, "tools", "max-repeat")


def test_a_schema_within_the_limits_still_gets_its_answer(client: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": wide_schema(50)}}
    r = chat(client, response_format=fmt)
    assert r.status_code == 200, r.text[:500]
    regex = chat(client, structured_outputs={"regex": "([a-z]+\\.)+[a-z]{2,3}"}, max_tokens=8)
    assert regex.status_code == 200, regex.text[:500]


# ----------------------------------------------------------------------------- generated attacks

NAMES = st.text("abcdefgh", min_size=1, max_size=6)
BOUNDS = st.sampled_from([0, 1, 3, 50, 1000, 9999, 10_001, 10**6])


def schemas() -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, BOUNDS),
        st.builds(lambda n: {"type": "string", "minLength": n}, BOUNDS),
        st.builds(lambda p: {"type": "string", "pattern": p}, regexes()),
        st.builds(lambda n: {"enum": list(range(n))}, st.sampled_from([1, 5, 999, 1001, 5000])),
        st.builds(
            lambda a, b: {"type": "integer", "minimum": a, "maximum": b},
            st.integers(-(10**18), 0),
            st.integers(0, 10**18),
        ),  # fmt: skip
        st.sampled_from([{"type": "boolean"}, {"type": "number"}, {}, True, {"type": "null"}]),
        st.sampled_from([{"not": {}}, {"type": "string", "format": "hostname-ish"}, {"$ref": "x"}]),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.builds(
                lambda props: {"type": "object", "properties": props, "required": list(props)},
                st.dictionaries(NAMES, inner, max_size=4),
            ),
            st.builds(
                lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, BOUNDS
            ),  # fmt: skip
            st.builds(lambda items: {"anyOf": items}, st.lists(inner, min_size=1, max_size=3)),
            st.builds(
                lambda s, n: {"type": "object", "properties": {f"p{i}": s for i in range(n)}},
                inner,
                st.sampled_from([10, 400, 6000]),
            ),
        ),  # fmt: skip
        max_leaves=12,
    )


def regexes() -> st.SearchStrategy[str]:
    atoms = st.sampled_from(["a", "b", ".", "[a-z]", "\\d", "\\w", "\\s", "\\.", "-", "x"])
    quantifiers = st.sampled_from(["", "", "*", "+", "?", "{3}", "{0,10}", "{1000}", "{2,20000}"])

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        group = st.builds(lambda body, q: f"({body}){q}", inner, quantifiers)
        seq = st.builds(lambda parts: "".join(parts), st.lists(inner, min_size=1, max_size=3))
        alt = st.builds(lambda a, b: f"{a}|{b}", inner, inner)
        return st.one_of(group, seq, alt)

    shaped = st.recursive(st.builds(lambda a, q: a + q, atoms, quantifiers), extend, max_leaves=8)
    raw = st.text("ab()[]{}*+?|\\.,0123^$", max_size=24)  # mostly invalid syntax
    return st.one_of(shaped, raw)


def grammars() -> st.SearchStrategy[str]:
    valid = st.builds(
        lambda words, rep: "root ::= (" + " | ".join(json.dumps(w) for w in words) + ")" + rep,
        st.lists(NAMES, min_size=1, max_size=5),
        st.sampled_from(["", "*", "+", "?", "{2,5}"]),
    )
    raw = st.text('root:=|"ab()*+? \n[]', max_size=40)
    return st.one_of(valid, raw)


def tool_lists() -> st.SearchStrategy[dict[str, Any]]:
    def request(params: list[Any], count: int, choice: str) -> dict[str, Any]:
        tools = [
            {"type": "function", "function": {"name": f"f{i}", "parameters": {
                "type": "object", "properties": {"a": params[i % len(params)]}}}}
            for i in range(count)
        ]  # fmt: skip
        chosen = {"type": "function", "function": {"name": "f0"}} if choice == "named" else choice
        return {"tools": tools, "tool_choice": chosen}

    return st.builds(
        request,
        st.lists(schemas(), min_size=1, max_size=3),
        st.sampled_from([1, 3, 128, 129, 400]),
        st.sampled_from(["auto", "required", "named", "none"]),
    )


def attacks() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(
            lambda s: {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": s},
                }
            },
            schemas(),
        ),  # fmt: skip
        st.builds(lambda s: {"structured_outputs": {"json": s}}, schemas()),
        st.builds(lambda r: {"structured_outputs": {"regex": r}}, regexes()),
        st.builds(lambda g: {"structured_outputs": {"grammar": g}}, grammars()),
        st.builds(
            lambda c: {"structured_outputs": {"choice": c}},
            st.lists(NAMES, min_size=1, max_size=1100),
        ),  # fmt: skip
        tool_lists(),
    )


def assert_answered(r: httpx.Response) -> None:
    """A 4xx in OpenAI's shape, or a result: never a 5xx."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert r.status_code == 400 and error["param"], error
    else:
        assert r.json()["choices"], r.text[:500]


@PROPERTY
@given(fields=attacks())
def test_generated_constraints_get_a_4xx_or_a_result_never_a_5xx(
    client: httpx.Client, fields: dict[str, Any]
) -> None:
    assert_answered(chat(client, **fields))


def test_a_plain_request_is_answered_while_an_attack_runs(client: httpx.Client) -> None:
    """One tenant sends schemas that each hold a compile lane (a 1700-property schema compiles
    for a second or more), refused regexes and an ambiguous grammar, nonstop; another
    tenant's plain requests and a small constrained one are answered meanwhile."""
    stop = threading.Event()
    statuses: list[int] = []

    def attack() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            schema = wide_schema(1700)
            schema["properties"]["p0"]["description"] = f"variant {i}"  # a cold compile each
            fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
            statuses.append(chat(client, response_format=fmt).status_code)
            statuses.append(chat(client, structured_outputs={"regex": "(a+)+b"}).status_code)
            # Ambiguous EBNF passes the static checks; the mask limit cuts it if it grows.
            ambiguous = {"grammar": 'root ::= ("a"*)* "b"'}
            statuses.append(chat(client, structured_outputs=ambiguous, max_tokens=64).status_code)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        while not statuses:  # the attack is under way
            attacker.join(0.05)
        for _ in range(3):
            assert chat(client, tenant="quiet").status_code == 200
        small = chat(client, tenant="quiet", structured_outputs={"choice": ["yes", "no"]})
        assert small.status_code == 200 and small.json()["choices"][0]["message"]["content"] in (
            "yes",
            "no",
        )
        assert attacker.is_alive()  # answered while the attack was still running
    finally:
        stop.set()
        attacker.join(HANG_S)
    assert statuses and all(s in (200, 400) for s in statuses), statuses
