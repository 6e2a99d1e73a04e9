"""What structured outputs cost: engine throughput with a JSON schema on every request against
the same requests unconstrained, grammar compile time cold and cached, and the two grammar
libraries side by side.

    python -m load.structured_bench                          # the default model, 64 requests
    python -m load.structured_bench --num-requests 32 --rounds 1   # a quick look
    python -m load.structured_bench --libraries              # + xgrammar vs llguidance

Throughput: ``--num-requests`` chat prompts through one in-process engine with
``--max-num-seqs`` (concurrency, default 16) sequences in flight, ``--max-tokens`` each.
Unconstrained requests ignore EOS (they always write ``--max-tokens``); constrained ones carry
the :data:`PERSON` schema and end when the JSON is complete, so both report output tokens/s
(tokens / wall time of the whole run). The two modes alternate for ``--rounds`` rounds in one
process (same weights, same warm caches) and the best round of each is compared: the ratio
is the number to keep >= 0.90. The schema's first compile is measured cold (a fresh compiler)
and then cached. A benchmark, never a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output import StructuredOutputManager

TARGET_RATIO = 0.90

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "favourite": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip_code": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip_code"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "nickname": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
    },
    "required": ["name", "age", "favourite", "address", "tags", "nickname"],
    "additionalProperties": False,
}
# What a tool call under tool_choice="required" compiles: anyOf over functions.
TOOL_CALL: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": {
                    "type": "object",
                    "properties": {"q": {"type": "string"}, "k": {"type": "integer"}},
                    "required": ["q"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in ("search", "lookup", "fetch")
    ]
}
SCHEMAS = {"person": PERSON, "tool_call": TOOL_CALL}
# A valid instance, tokenized to walk the matchers token by token (mask-time measurement).
PERSON_EXAMPLE = {
    "name": "Ada Lovelace",
    "age": 36,
    "favourite": "green",
    "address": {"city": "London", "zip_code": "12345"},
    "tags": ["math", "poetry"],
    "nickname": None,
}

SUBJECTS = ["a sailor", "a chemist", "a baker", "a pianist", "a diver", "a tailor", "a poet"]


def prompts(llm: LLM, num: int) -> list[list[int]]:
    out = []
    for i in range(num):
        messages = [{"role": "user", "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]} #{i}."}]
        text = llm.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        out.append(llm.tokenizer.encode(text, add_special_tokens=False))
    return out


def run_round(llm: LLM, batch: list[list[int]], params: SamplingParams) -> dict[str, float]:
    start = time.perf_counter()
    outputs = llm.generate(batch, params)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    valid = 0
    for o in outputs:
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "valid_json": valid,
        "finished_stop": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
    }


def compile_times(llm: LLM) -> dict[str, dict[str, float]]:
    """Per schema, in ms: cold (a fresh manager whose vocabulary table is built; the compile
    alone) and cached (a second request for the same schema)."""
    engine = llm.engine
    result = {}
    for name, schema in SCHEMAS.items():
        manager = StructuredOutputManager(
            engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids), 16
        )
        spec = StructuredOutputsParams(json=schema)
        manager.grammar_for(StructuredOutputsParams(regex="a")).wait(60)  # setup done
        start = time.perf_counter()
        state = manager.grammar_for(spec)
        while not state.is_ready:
            state.wait(0.001)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        state = manager.grammar_for(spec)
        while not state.is_ready:
            state.wait(0.001)
        cached = time.perf_counter() - start
        result[name] = {
            "cold_ms": cold * 1000,
            "compile_only_ms": manager.stats.last_compile_seconds * 1000,
            "tokenizer_setup_ms": manager.stats.tokenizer_setup_seconds * 1000,
            "cached_ms": cached * 1000,
        }
        manager.close()
    return result


def compare_libraries(llm: LLM) -> dict[str, dict[str, float]]:
    """xgrammar vs llguidance on the Person schema: tokenizer setup, compile, mask per token."""
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr

    tokenizer = llm.engine.tokenizer
    vocab = llm.engine.vocab_size
    eos = sorted(llm.engine.eos_token_ids)
    doc = llm.tokenizer.encode(json.dumps(PERSON_EXAMPLE), add_special_tokens=False) + eos[:1]
    out: dict[str, dict[str, float]] = {}

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(PERSON)
    t2 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    masks = []
    for token in doc:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - s)
        if not matcher.accept_token(token):
            raise RuntimeError("xgrammar refused the example document")
    out["xgrammar"] = {
        "tokenizer_setup_ms": (t1 - t0) * 1000,
        "compile_ms": (t2 - t1) * 1000,
        "mask_us_mean": statistics.mean(masks) * 1e6,
        "mask_us_max": max(masks) * 1e6,
    }

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos[0])  # type: ignore[arg-type]
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(PERSON)
    llm_matcher = llguidance.LLMatcher(lltok, grammar)
    t2 = time.perf_counter()
    if llm_matcher.is_error():
        raise RuntimeError(llm_matcher.get_error())
    llbitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    masks = []
    for token in doc:
        s = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(llm_matcher, llbitmask, 0)
        masks.append(time.perf_counter() - s)
        if not llm_matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused the example: {llm_matcher.get_error()}")
    out["llguidance"] = {
        "tokenizer_setup_ms": (t1 - t0) * 1000,
        "compile_ms": (t2 - t1) * 1000,
        "mask_us_mean": statistics.mean(masks) * 1e6,
        "mask_us_max": max(masks) * 1e6,
    }
    out["document_tokens"] = {"n": float(len(doc))}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="concurrency")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--libraries", action="store_true", help="also xgrammar vs llguidance")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, kv_cache_memory="256MiB")
    batch = prompts(llm, args.num_requests)
    free = SamplingParams(temperature=0.8, seed=1, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )
    result: dict[str, Any] = {"compile": compile_times(llm)}
    run_round(llm, batch[:4], free)  # warm up both paths (and compile the schema once)
    run_round(llm, batch[:4], constrained)
    rounds: dict[str, list[dict[str, float]]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.rounds):
        rounds["unconstrained"].append(run_round(llm, batch, free))
        rounds["json_schema"].append(run_round(llm, batch, constrained))
    best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in rounds.items()}
    ratio = best["json_schema"]["tokens_per_s"] / best["unconstrained"]["tokens_per_s"]
    stats = llm.engine.stats()
    result.update(
        rounds=rounds,
        best=best,
        ratio=ratio,
        target_ratio=TARGET_RATIO,
        engine_grammar_compiles=stats.grammar_compiles,
        engine_grammar_cache_hits=stats.grammar_cache_hits,
        machine={
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
            "device": str(llm.engine.runner.device),
        },
        command="python -m load.structured_bench " + " ".join(argv or sys.argv[1:]),
    )
    if args.libraries:
        result["libraries"] = compare_libraries(llm)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    print(
        f"json_schema {best['json_schema']['tokens_per_s']:.1f} tok/s vs unconstrained "
        f"{best['unconstrained']['tokens_per_s']:.1f} tok/s: {ratio:.1%} "
        f"(target {TARGET_RATIO:.0%})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
