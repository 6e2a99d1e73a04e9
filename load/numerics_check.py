"""What the engine's numerics paths do to outputs: ``python -m load.numerics_check``.

Greedy continuations of fixed chat prompts on the default model, decoded one request at a time,
in several configurations of the same weights:

* ``float32 dense``: float32 with the dense matmuls (``--quantization none``): token for token
  what transformers produces (the test suite checks that), so it is the reference here;
* ``float32``: float32 on the GGUF blocks (``--dtype float32``): every step on the batch
  invariant panel kernel (issue 42);
* ``auto``: no flags, what ``portico engine`` and ``make run`` serve (``--dtype auto``:
  float32 on the GGUF blocks on every CPU, engine/numerics.py); the report names its path;
* ``bfloat16``: the opt-in bf16 activations, exact products on the blocks
  (``--dtype bfloat16 --gguf-activations exact``);
* ``bfloat16+int8``: bf16 activations rounded to int8 per 32 values before the block linears
  (``--dtype bfloat16``, whose ``--gguf-activations`` is int8), as llama.cpp does;

and, for ``--kv-cache-dtype`` (issue 33), bf16 + int8 activations with its KV cache in ``int8``
and in ``fp8_e4m3`` instead of bf16, and the default with its cache in ``float16`` instead of
float32.

With ``--configs``, also ``--quantization fp8`` (issue 41; slow on a CPU, so not in the
default run): ``fp8`` (float32 activations) against ``float32 dense`` and ``fp8, bfloat16``
against ``bfloat16 dense`` (``fp8_vs_dense`` in the report).

For each configuration it reports how many continuations equal the reference's, and how many
tokens agree on average before the first difference; each smaller cache also against the
model's own cache with everything else equal. And the perplexity of every configuration on a
fixed text (:data:`PERPLEXITY_TEXT`: the first 1024 tokens of CPython's LICENSE.txt, shipped
with every Python; its sha256 is in the report), read through the paged cache in chunks of
``max_num_batched_tokens``. ``default_requirements`` checks issue 42's quality bar for
``auto``: greedy replies equal the reference's on at least 11 of the 12 :data:`PROOF_PROMPTS`,
perplexity within 1% of the reference's; ``kv_float16_requirements`` the same bar for ``auto,
kv float16``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
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
# The 12 everyday prompts of issue 42's proof (README's example first): the quality bar and
# tests/engine/test_batch_invariance.py's prompts.
PROOF_PROMPTS = PROMPTS[:12]
REFERENCE = "float32 dense"

CONFIGS = {
    REFERENCE: {"dtype": "float32", "quantization": "none"},
    "float32": {"dtype": "float32", "gguf_activations": "exact"},
    "bfloat16": {"dtype": "bfloat16", "gguf_activations": "exact"},
    "bfloat16+int8": {"dtype": "bfloat16", "gguf_activations": "int8"},
    "bfloat16+int8, kv int8": {
        "dtype": "bfloat16", "gguf_activations": "int8", "kv_cache_dtype": "int8",
    },
    "bfloat16+int8, kv fp8_e4m3": {
        "dtype": "bfloat16", "gguf_activations": "int8", "kv_cache_dtype": "fp8_e4m3",
    },
    "auto": {},
    # --kv-cache-dtype float16 under the default float32 path: half the cache's bytes
    "auto, kv float16": {"kv_cache_dtype": "float16"},
    # --quantization fp8 (issue 41): the projections in e4m3, torch's CPU scaled matmul
    "bfloat16 dense": {"dtype": "bfloat16", "quantization": "none"},
    "fp8": {"dtype": "float32", "quantization": "fp8"},
    "fp8, bfloat16": {"dtype": "bfloat16", "quantization": "fp8"},
}  # fmt: skip
# Each fp8 configuration, and the dense one of the same activation dtype.
FP8_PAIRS = {"fp8": REFERENCE, "fp8, bfloat16": "bfloat16 dense"}
# The default run: fp8's configurations are slow on a CPU (torch's reference fp8 kernel);
# name them with --configs.
DEFAULT_CONFIGS = [name for name in CONFIGS if name not in ("bfloat16 dense", *FP8_PAIRS)]
# Each smaller cache's configuration, and the same one with the model's own cache.
CACHE_PAIRS = {
    "auto, kv float16": "auto",
    "bfloat16+int8, kv int8": "bfloat16+int8",
    "bfloat16+int8, kv fp8_e4m3": "bfloat16+int8",
}
PERPLEXITY_TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
PERPLEXITY_TOKENS = 1024


def continuations(llm: LLM, max_tokens: int) -> list[list[int]]:
    """Greedy continuations of :data:`PROMPTS`, one request at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for prompt in PROMPTS:
        result = llm.chat([{"role": "user", "content": prompt}], params)[0]
        out.append(list(result.outputs[0].token_ids))
    return out


def perplexity(llm: LLM, text: str, num_tokens: int) -> float:
    """exp of the mean negative log-likelihood of the first ``num_tokens`` tokens of ``text``
    (each predicted from the ones before it, from the prompt's logprobs)."""
    ids = llm.tokenizer.encode(text)[:num_tokens]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([ids], params)[0]
    values = [p.logprob for p in out.prompt_logprobs or [] if p is not None]
    return math.exp(-sum(values) / len(values))


def run_config(
    config: dict[str, str], max_tokens: int, text: str
) -> tuple[list[list[int]], float, Any]:
    """One configuration's continuations, its perplexity on ``text`` and the engine's numerics
    (``/v1/models``'s description of the path it ran)."""
    llm = LLM(device="cpu", max_num_seqs=1, enable_prefix_caching=False, **config)
    try:
        tokens = continuations(llm, max_tokens)
        return tokens, perplexity(llm, text, PERPLEXITY_TOKENS), llm.engine.numerics.as_dict()
    finally:
        llm.engine.close()


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


def requirements(
    results: dict[str, tuple[list[list[int]], float, Any]], name: str = "auto"
) -> dict[str, Any]:
    """Issue 42's quality bar for the default (``auto``), or configuration ``name``, against the
    dense float32 reference: identical greedy replies on at least 11 of the 12 proof prompts,
    perplexity within 1%."""
    reference, ref_ppl, _ = results[REFERENCE]
    default, ppl, _ = results[name]
    proof = len(PROOF_PROMPTS)
    same = sum(r == d for r, d in zip(reference[:proof], default[:proof], strict=True))
    ratio = ppl / ref_ppl
    return {
        "identical_on_proof_prompts": f"{same}/{proof}",
        "identical_at_least_11_of_12": same >= proof - 1,
        "perplexity_ratio": round(ratio, 5),
        "perplexity_within_1_percent": abs(ratio - 1) <= 0.01,
    }


def fp8_vs_dense(
    fp8: tuple[list[list[int]], float, Any], dense: tuple[list[list[int]], float, Any]
) -> dict[str, Any]:
    """Issue 41's bar for ``--quantization fp8``: perplexity within 1% of the dense model's
    with the same activation dtype; and its greedy replies against the dense ones."""
    ratio = fp8[1] / dense[1]
    return {
        **agreement(dense[0], fp8[0]),
        "perplexity_ratio": round(ratio, 5),
        "perplexity_within_1_percent": abs(ratio - 1) <= 0.01,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", default=".portico/bench/numerics_check.json")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=DEFAULT_CONFIGS)
    args = parser.parse_args(argv)
    text = PERPLEXITY_TEXT.read_text()
    results = {name: run_config(CONFIGS[name], args.max_tokens, text) for name in args.configs}
    runs = {name: tokens for name, (tokens, _, _) in results.items()}
    report = {
        "prompts": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "paths": {name: numerics for name, (_, _, numerics) in results.items()},
        "vs_float32_dense": {name: agreement(runs[REFERENCE], runs[name]) for name in runs}
        if REFERENCE in runs
        else {},
        "default_requirements": requirements(results) if {REFERENCE, "auto"} <= set(runs) else {},
        "kv_float16_requirements": requirements(results, "auto, kv float16")
        if {REFERENCE, "auto, kv float16"} <= set(runs)
        else {},
        "int8_vs_bfloat16": agreement(runs["bfloat16"], runs["bfloat16+int8"])
        if {"bfloat16", "bfloat16+int8"} <= set(runs)
        else {},
        "kv_cache_vs_models_cache": {
            name: agreement(runs[base], runs[name])
            for name, base in CACHE_PAIRS.items()
            if {name, base} <= set(runs)
        },
        "fp8_vs_dense": {
            name: fp8_vs_dense(results[name], results[base])
            for name, base in FP8_PAIRS.items()
            if {name, base} <= set(runs)
        },
        "perplexity": {name: ppl for name, (_, ppl, _) in results.items()},
        "perplexity_text": {
            "file": PERPLEXITY_TEXT.name,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "tokens": PERPLEXITY_TOKENS,
        },
    }
    print(json.dumps(report, indent=2))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
