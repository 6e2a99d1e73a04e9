"""What the engine's speed paths do to outputs: ``python -m load.numerics_check``.

Greedy continuations of fixed chat prompts on the default model, decoded one request at a time
(the one-stream path: GGUF block linears, and with int8 activations the fused native step), in
three configurations of the same weights:

* ``float32``: exact products; token for token what transformers produces (the test suite
  checks that), so it is the reference here;
* ``bfloat16``: bf16 activations, exact products on the blocks (``--gguf-activations exact``);
* ``bfloat16+int8``: bf16 activations rounded to int8 per 32 values before the block linears
  (``--gguf-activations int8``, the default), as llama.cpp does;
* ``auto``: no flags, what ``portico engine`` and ``make run`` serve here (``--dtype auto``
  resolves per CPU, engine/numerics.py); the report names the path it took and why.

For each configuration it reports how many continuations equal the reference's, and how many
tokens agree on average before the first difference. A benchmark-style report, not a test:
bf16 is already not float32, and the question is whether int8 moves outputs further.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a Python function that reverses a string.",
    "List three uses of a paperclip.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Give me a haiku about autumn.",
    "Summarize the plot of Romeo and Juliet.",
    "What does HTTP stand for?",
    "How do I make a cup of tea?",
    "Name the planets of the solar system.",
    "What is a prime number? Give two examples.",
    "Write a SQL query that counts the rows of a table named users.",
    "What are the benefits of regular exercise?",
    "Describe a cat to someone who has never seen one.",
]

CONFIGS = {
    "float32": {"dtype": "float32", "gguf_activations": "exact"},
    "bfloat16": {"dtype": "bfloat16", "gguf_activations": "exact"},
    "bfloat16+int8": {"dtype": "bfloat16", "gguf_activations": "int8"},
    "auto": {},
}


def continuations(config: dict[str, str], max_tokens: int) -> tuple[list[list[int]], Any]:
    """Greedy continuations of :data:`PROMPTS`, one request at a time, and the engine's
    numerics (``/v1/models``'s description of the path it ran)."""
    llm = LLM(device="cpu", max_num_seqs=1, enable_prefix_caching=False, **config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for prompt in PROMPTS:
        result = llm.chat([{"role": "user", "content": prompt}], params)[0]
        out.append(list(result.outputs[0].token_ids))
    numerics = llm.engine.numerics.as_dict()
    llm.engine.close()
    return out, numerics


def agreement(reference: Sequence[list[int]], other: Sequence[list[int]]) -> dict[str, float]:
    """Identical continuations, and the mean number of tokens before the first difference."""
    identical = 0
    prefix_total = 0
    for ref, got in zip(reference, other, strict=True):
        n = 0
        while n < min(len(ref), len(got)) and ref[n] == got[n]:
            n += 1
        identical += ref == got
        prefix_total += n
    return {"identical": identical / len(reference), "mean_prefix": prefix_total / len(reference)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", default=".portico/bench/numerics_check.json")
    args = parser.parse_args(argv)
    results = {name: continuations(config, args.max_tokens) for name, config in CONFIGS.items()}
    runs = {name: tokens for name, (tokens, _) in results.items()}
    report = {
        "prompts": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "paths": {name: numerics for name, (_, numerics) in results.items()},
        "vs_float32": {name: agreement(runs["float32"], runs[name]) for name in runs},
        "int8_vs_bfloat16": agreement(runs["bfloat16"], runs["bfloat16+int8"]),
    }
    print(json.dumps(report, indent=2))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
