"""Speculative decoding against none, same engine build, same model, same prompts, one run.

    python -m load.spec_bench                              # the default model, both workloads
    python -m load.spec_bench --num-requests 8 --rounds 1  # a quick look
    python -m load.spec_bench --sweep 1,2,4,8,16           # where the off switch should sit

Workloads (fixed): **copy-heavy** — rewrite a given code file with one change, and answer by
quoting a given passage (the output repeats the prompt); **chat** — short open questions
through the chat template (the output repeats little). Each runs single stream (one request
at a time) and at concurrency 16 (``--max-num-seqs`` 16, all requests queued at once), on two
in-process engines over the same loaded weights: one without speculation and one with
``--spec`` (default: n-gram, 3 guesses, the default ``disable_by_batch_size``). Decoding is
greedy, so both engines write exactly the same tokens (checked); reported is output tokens
per second (tokens / wall time), the ratio, and the acceptance rate. Rounds alternate the two
engines and the best round of each counts. ``--sweep`` runs the chat workload at each listed
concurrency with speculation always on, to find where it stops paying. A benchmark, never a
test: numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_loader import choose_device, choose_dtype, load_model
from engine.sampling_params import SamplingParams
from portico.registry import resolve

TARGET_COPY_SINGLE = 1.8
TARGET_CHAT_C16 = 0.95
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'

CODE = '''def parse_size(text: str) -> int:
    """Bytes from a size such as 2GiB, 512MiB or a plain number of bytes."""
    units = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    number = text.rstrip("kmg")
    unit = text[len(number):]
    if unit not in units:
        raise ValueError(f"unknown unit in {text!r}")
    value = float(number) * units[unit]
    if value <= 0:
        raise ValueError("size must be positive")
    return int(value)


def format_size(num_bytes: int) -> str:
    """The shortest exact binary form of a byte count."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)
'''
CODE_CHANGES = [
    "Rename the function parse_size to read_size.",
    "Rename the variable num_bytes to size.",
    "Change the error message 'size must be positive' to 'size must be above zero'.",
    "Rename the variable units to factors.",
]
PASSAGE = (
    "The lighthouse on the northern cape was built in 1874 from granite quarried two miles "
    "inland. Its lamp burned whale oil until 1902, when the keepers switched to kerosene, and "
    "it was electrified in 1931. The last keeper, Margaret Holloway, left in 1967, after which "
    "the light ran automatically. The tower is 31 metres tall and its beam can be seen 22 "
    "nautical miles out to sea. Since 1985 the keeper's cottage has housed a small museum of "
    "maritime history, open from May to September."
)
QUESTIONS = [
    "When was the lighthouse electrified, and what did it burn before that?",
    "Who was the last keeper and when did she leave?",
    "How tall is the tower and how far can its beam be seen?",
    "What is in the keeper's cottage today?",
]
CHAT = [
    "Give three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Describe a sailor's day at sea.",
    "Why is the sky blue?",
    "Write a short poem about autumn.",
    "How do vaccines work?",
    "Explain recursion to a child.",
    "What should I pack for a weekend hike?",
]


def chat_prompt(llm: LLM, content: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return list(llm.tokenizer.encode(text, add_special_tokens=False))


def workloads(llm: LLM, num: int) -> dict[str, list[list[int]]]:
    copy = []
    for i in range(num):
        if i % 2 == 0:
            change = CODE_CHANGES[(i // 2) % len(CODE_CHANGES)]
            content = f"{change} Output the whole file.\n\n```python\n{CODE}```"
        else:
            question = QUESTIONS[(i // 2) % len(QUESTIONS)]
            content = f"{PASSAGE}\n\nQuote the sentence of the passage that answers: {question}"
        copy.append(chat_prompt(llm, content))
    chat = [chat_prompt(llm, CHAT[i % len(CHAT)] + f" (#{i})") for i in range(num)]
    return {"copy": copy, "chat": chat}


def run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> dict[str, Any]:
    engine = llm.engine
    before = engine.stats()
    start = time.perf_counter()
    if concurrency == 1:
        outs = [llm.generate([p], params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = engine.stats()
    tokens = [o.outputs[0].token_ids for o in outs]
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    num_tokens = sum(len(t) for t in tokens)
    return {
        "seconds": round(seconds, 3),
        "output_tokens": num_tokens,
        "tokens_per_s": round(num_tokens / seconds, 2),
        "steps": after.num_steps - before.num_steps,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "drafted": drafted,
        "tokens": tokens,
    }


def compare(
    plain: LLM, spec: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int,
    rounds: int,
) -> dict[str, Any]:  # fmt: skip
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for name, llm in (("plain", plain), ("spec", spec)):
            llm.engine.config.max_num_seqs = concurrency  # the scheduler reads the same object
            result = run(llm, prompts, params, concurrency)
            if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = result
    same = best["plain"].pop("tokens") == best["spec"].pop("tokens")
    return {
        "concurrency": concurrency,
        "plain": best["plain"],
        "spec": best["spec"],
        "ratio": round(best["spec"]["tokens_per_s"] / best["plain"]["tokens_per_s"], 3),
        "identical_outputs": same,
    }


def make_llm(loaded: Any, args: argparse.Namespace, spec: str | None) -> LLM:
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=16,
        quantization=args.quantization,
        kv_cache_memory=args.kv_cache_memory, speculative_config=spec,
    )  # fmt: skip
    return LLM.from_engine(LLMEngine(config, loaded))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.spec_bench", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (1: the shared 2-core machine stalls on more)",
    )  # fmt: skip
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="--speculative-config JSON")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--sweep", default="", help="concurrencies for the chat sweep, e.g. 1,2,4,8,16"
    )
    parser.add_argument("--workloads", default="copy,chat", help="which of copy,chat to run")
    parser.add_argument("--concurrency", default="1,16", help="which of 1,16 to run")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    loaded = load_model(resolve(args.model), dtype, device, args.quantization)
    plain = make_llm(loaded, args, None)
    spec = make_llm(loaded, args, args.spec)
    work = workloads(plain, args.num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results: dict[str, Any] = {
        "command": " ".join(["python -m load.spec_bench", *(argv or sys.argv[1:])]),
        "spec": spec.engine.config.speculative.to_json(),  # type: ignore[union-attr]
        "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        },
        "runs": [],
    }  # fmt: skip
    single = max(1, args.num_requests // 4)  # single stream: a quarter of the requests
    wanted = {int(c) for c in args.concurrency.split(",") if c}
    for name in [w for w in ("copy", "chat") if w in args.workloads.split(",")]:
        for concurrency, prompts in ((1, work[name][:single]), (16, work[name])):
            if concurrency not in wanted:
                continue
            row = compare(plain, spec, prompts, params, concurrency, args.rounds)
            row["workload"] = name
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    if args.sweep:
        always = json.loads(args.spec)
        always["disable_by_batch_size"] = None
        spec_on = make_llm(loaded, args, json.dumps(always))
        results["sweep"] = []
        for concurrency in (int(c) for c in args.sweep.split(",")):
            prompts = work["chat"][: max(concurrency, args.num_requests)]
            row = compare(plain, spec_on, prompts, params, concurrency, args.rounds)
            results["sweep"].append(row)
            print(json.dumps({"sweep": row}), flush=True)
    results["machine"]["load_average_after"] = os.getloadavg()
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
