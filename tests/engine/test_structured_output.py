"""Constrained decoding end to end on the tiny random Llama (real xgrammar, loader, scheduler,
runner, sampler): the output matches its grammar, compilation never stalls the others, and
preemption, n > 1, max_tokens and mixed batches keep their promises."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any

import pytest

from engine.model_loader import LoadedModel
from engine.outputs import RequestOutput
from engine.sampling_params import ParameterError, SamplingParams, StructuredOutputsParams
from tests.engine.tiny_engine import make_engine, run_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["name", "age", "tag"],
    "additionalProperties": False,
}


def prompt(n: int, start: int = 100) -> list[int]:
    return [(start + 7 * i) % 4000 + 10 for i in range(n)]


def constrained(max_tokens: int = 60, temperature: float = 0.0, **kw: Any) -> SamplingParams:
    # Compact JSON: a random model left free would spend max_tokens on whitespace.
    fields = {"disable_any_whitespace": True, **(kw or {"json": SCHEMA})}
    spec = StructuredOutputsParams(**fields)
    return SamplingParams(
        temperature=temperature, max_tokens=max_tokens, seed=7, structured_outputs=spec
    )


def assert_valid(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "tag"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99
    assert value["tag"] in ("a", "b")


def test_json_schema_output_parses_and_validates_and_finishes_with_stop(
    tiny: LoadedModel,
) -> None:
    engine = make_engine(tiny)
    for i in range(3):
        engine.add_request(f"r{i}", prompt(5, 100 + i), constrained(temperature=1.0))
    final = run_all(engine)
    for out in final.values():
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert_valid(out.outputs[0].text)
    assert engine.stats().grammar_compiles == 1  # one schema: compiled once, then cached
    assert engine.stats().grammar_cache_hits == 2


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        ({"regex": r"[0-9]{3}-[a-c]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-c]{2}", t)),
        ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        (
            {"grammar": 'root ::= "(" [a-z] [a-z]? [a-z]? ")"'},
            lambda t: re.fullmatch(r"\([a-z]{1,3}\)", t),
        ),
    ],
)
def test_regex_choice_grammar_and_json_object_hold(
    tiny: LoadedModel, spec: dict[str, Any], check: Any
) -> None:
    engine = make_engine(tiny)
    engine.add_request("r", prompt(6), constrained(max_tokens=200, temperature=1.0, **spec))
    out = run_all(engine)["r"].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert check(out.text), out.text


def test_json_object_is_an_object_or_ends_with_length(tiny: LoadedModel) -> None:
    # A random model writes endless strings: an unfinished object must say "length".
    engine = make_engine(tiny)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(6, 40 + i), constrained(max_tokens=80, json_object=True))
    for out in run_all(engine).values():
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert reason == "length"


def test_unsupported_schema_feature_is_a_parameter_error_that_names_it(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    bad = SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": 3})
    )
    with pytest.raises(ParameterError) as info:
        engine.add_request("r", prompt(4), bad)
    assert info.value.param == "structured_outputs"
    assert "properties must be an object" in str(info.value)
    for keyword, schema in [
        ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
        ("uniqueItems", {"type": "array", "uniqueItems": True}),
        ("multipleOf", {"type": "integer", "multipleOf": 3}),
    ]:
        with pytest.raises(ParameterError, match=f"`{keyword}`"):
            spec = StructuredOutputsParams(json=schema)
            engine.add_request("r", prompt(4), SamplingParams(structured_outputs=spec))
    bad_regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ParameterError):
        engine.add_request("r", prompt(4), bad_regex)
    assert not engine.has_unfinished()


def test_max_tokens_first_finishes_with_length_not_stop(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    engine.add_request("r", prompt(5), constrained(max_tokens=3))
    out = run_all(engine)["r"].outputs[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 3
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_unconstrained_rows_in_a_mixed_batch_get_exactly_their_tokens_alone(
    tiny: LoadedModel,
) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = make_engine(tiny)
    for i in range(3):
        alone.add_request(f"u{i}", prompt(7, 300 + i), free)
    expected = {k: v.outputs[0].token_ids for k, v in run_all(alone).items()}

    mixed = make_engine(tiny)
    for i in range(3):
        mixed.add_request(f"c{i}", prompt(5, 500 + i), constrained())
        mixed.add_request(f"u{i}", prompt(7, 300 + i), free)
    final = run_all(mixed)
    assert {k: final[k].outputs[0].token_ids for k in expected} == expected
    for i in range(3):
        assert_valid(final[f"c{i}"].outputs[0].text)


def test_a_request_waiting_for_its_grammar_does_not_stall_the_others(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    engine.add_request("free", prompt(6), SamplingParams(temperature=0.0, max_tokens=4))
    gate = threading.Event()
    pool = engine.structured.pool
    run_job = pool._run_job
    pool._run_job = lambda lane, spec: (gate.wait(), run_job(lane, spec))[1]  # type: ignore[method-assign]
    engine.add_request("json", prompt(5), constrained())
    final: dict[str, RequestOutput] = {}
    for _ in range(20):  # the free request finishes while the grammar cannot compile
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if "free" in final:
            break
    assert "free" in final and "json" not in final
    assert engine.stats().num_waiting_for_grammar == 1
    gate.set()
    final.update(run_all(engine))
    assert_valid(final["json"].outputs[0].text)
    assert engine.stats().num_waiting_for_grammar == 0


def test_n_greater_than_one_gives_each_child_its_own_matcher(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, enable_prefix_caching=True)
    params = constrained(temperature=1.0)
    params.n = 3
    engine.add_request("r", prompt(20), params)
    out = run_all(engine)["r"]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        assert_valid(completion.text)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_resume_with_the_same_valid_output(
    tiny: LoadedModel, mode: str
) -> None:
    def outputs(**overrides: Any) -> dict[str, list[int]]:
        engine = make_engine(tiny, **overrides)
        for i in range(4):
            engine.add_request(f"r{i}", prompt(30, 100 + 13 * i), constrained())
        final = run_all(engine)
        for out in final.values():
            assert_valid(out.outputs[0].text)
        if overrides:
            assert engine.stats().num_preemptions > 0
        return {k: v.outputs[0].token_ids for k, v in final.items()}

    roomy = outputs()
    tight = outputs(num_gpu_blocks_override=8, block_size=16, preemption_mode=mode)
    assert tight == roomy


def test_chunked_prefill_and_prefix_cache_give_the_same_constrained_output(
    tiny: LoadedModel,
) -> None:
    plain = make_engine(tiny)
    plain.add_request("r", prompt(40), constrained())
    expected = run_all(plain)["r"].outputs[0].token_ids
    chunked = make_engine(tiny, max_num_batched_tokens=16, enable_prefix_caching=True)
    chunked.add_request("a", prompt(40), constrained())
    chunked.add_request("b", prompt(40), constrained())
    final = run_all(chunked)
    assert final["a"].outputs[0].token_ids == expected == final["b"].outputs[0].token_ids


def test_grammar_end_finishes_even_with_ignore_eos(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    params = constrained(choice=["done"])
    params.ignore_eos = True
    engine.add_request("r", prompt(5), params)
    out = run_all(engine)["r"].outputs[0]
    assert out.text == "done" and out.finish_reason == "stop"


# ----------------------------------------------------------------------------- the compile pool


def wide_schema(num_properties: int) -> dict[str, Any]:
    """An object of many required string properties: its compile grows with the count (30000
    take minutes; 1000 a fraction of a second)."""
    props = {f"p{i}": {"type": "string", "description": "x" * 20} for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_a_compile_past_its_budget_is_refused_naming_the_limit_and_its_worker_replaced(
    tiny: LoadedModel,
) -> None:
    # Limits opened so the 2 MB schema reaches the compiler; only the budget stops it.
    engine = make_engine(
        tiny,
        structured_outputs_compile_timeout=0.5,
        structured_outputs_max_bytes=10**8,
        structured_outputs_max_properties=10**6,
        structured_outputs_max_nodes=10**7,
    )
    manager = engine.structured
    huge = StructuredOutputsParams(json=wide_schema(30_000))
    with pytest.raises(ParameterError) as info:
        asyncio.run(manager.prepare(huge, "response_format", "evil"))
    assert info.value.param == "response_format"
    assert "--structured-outputs-compile-timeout" in str(info.value)
    assert manager.pool.stats.num_workers_replaced == 1
    # The same spec is refused from the cache, without holding a worker again.
    with pytest.raises(ParameterError):
        asyncio.run(manager.prepare(huge, "response_format", "evil"))
    assert manager.stats.num_timed_out == 1
    # The fresh worker compiles, and the engine serves a constrained request.
    engine.add_request("r", prompt(5), constrained())
    assert_valid(run_all(engine)["r"].outputs[0].text)
    # A request whose grammar ran past its budget in the engine is aborted, nothing else.
    engine.add_request("late", prompt(5), SamplingParams(structured_outputs=huge))
    assert run_all(engine)["late"].outputs[0].finish_reason == "abort"
    engine.close()


def test_one_tenants_compiles_hold_at_most_its_share_of_the_lanes(tiny: LoadedModel) -> None:
    """Two lanes, one compile per tenant: while tenant A's first compile is stuck, its second
    waits and tenant B's compiles on the other lane."""
    engine = make_engine(
        tiny, structured_outputs_compile_workers=2, structured_outputs_compile_per_tenant=1
    )
    pool = engine.structured.pool
    gate = threading.Event()
    started: list[str] = []
    run_job = pool._run_job

    def gated(lane: int, spec: StructuredOutputsParams) -> Any:
        started.append(spec.regex or "")
        if spec.regex and spec.regex.startswith("a"):
            gate.wait()
        return run_job(lane, spec)

    pool._run_job = gated  # type: ignore[method-assign]
    a1 = engine.structured.grammar_for(StructuredOutputsParams(regex="a[0-9]"), "A")
    a2 = engine.structured.grammar_for(StructuredOutputsParams(regex="ab[0-9]"), "A")
    b = engine.structured.grammar_for(StructuredOutputsParams(regex="b[0-9]"), "B")
    b.wait(60)
    assert b.is_ready and b.error is None
    assert not a1.is_ready and not a2.is_ready
    assert started == ["a[0-9]", "b[0-9]"]  # A's second compile never took the free lane
    gate.set()
    a2.wait(60)
    assert a1.is_ready and a2.is_ready and a2.error is None
    engine.close()


def test_a_sequence_whose_mask_costs_more_than_the_limit_is_cut_and_the_others_go_on(
    tiny: LoadedModel,
) -> None:
    """An ambiguous grammar (nested stars: its mask grows with every token) passes the static
    checks, which do not look inside EBNF; the mask limit cuts it. A limit of one nanosecond
    makes the first mask over it, so the test does not depend on the machine's speed."""
    engine = make_engine(tiny, structured_outputs_max_mask_ms=1e-6)
    ambiguous = StructuredOutputsParams(grammar='root ::= ("a"*)* "b"')
    engine.add_request(
        "evil", prompt(5), SamplingParams(max_tokens=50, structured_outputs=ambiguous)
    )
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("free", prompt(7, 300), free)
    final = run_all(engine)
    evil = final["evil"].outputs[0]
    assert evil.finish_reason == "length" and len(evil.token_ids) == 1
    assert final["free"].outputs[0].finish_reason == "length"
    assert len(final["free"].outputs[0].token_ids) == 12
    assert engine.structured.stats.num_slow_masks == 1
    engine.close()
