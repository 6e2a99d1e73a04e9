"""What one engine step costs against the tokens in it: ``python -m load.step_cost``.

    python -m load.step_cost                         # the default model, its default flags
    python -m load.step_cost --decodes 16 --sizes 0,16,64,256,512,1024,2048 --reps 3

An in-process ``LLMEngine`` built from the engine's own defaults (``--dtype auto``, so the
numerics a served engine takes) keeps ``--decodes`` requests decoding; each measured step
adds one prefill of P tokens (P from ``--sizes``) that runs whole in that step, so the step
is P prefill tokens plus the decodes. Reported per P: the step's median and least wall time
over ``--reps`` rounds (sizes interleaved, so a drift of the machine's load weighs on all),
and the least time per prefill token over the decode-only step. What it answers: how long a
request that arrives mid-step waits for the step to end (the fair scheduler's
``--fair-contended-prefill-tokens`` and ``--fair-short-prefill-tokens`` bound that), and
whether a smaller ``--max-num-batched-tokens`` costs throughput. A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def measure(
    model: str, decodes: int, sizes: list[int], reps: int, seed: int = 0
) -> dict[int, list[float]]:
    """Milliseconds of each measured step, by prefill size."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tenancy import TenantTag

    rng = random.Random(seed)
    budget = max(sizes) + decodes
    config = EngineConfig(model=model, max_num_batched_tokens=budget, scheduling_policy="fcfs")
    times: dict[int, list[float]] = {p: [] for p in sizes}
    with torch.inference_mode():
        engine = LLMEngine.from_config(config)
        print(f"numerics: {engine.numerics.name} ({engine.numerics.reason})", file=sys.stderr)
        vocab = engine.model_config.vocab_size

        def prompt(n: int) -> list[int]:  # fresh ids: the prefix cache serves nothing
            return [rng.randrange(min(100, vocab - 1), vocab) for _ in range(n)]

        long = SamplingParams(max_tokens=4 * reps * len(sizes) + 8, ignore_eos=True)
        for i in range(decodes):
            engine.add_request(f"d{i}", prompt(128), long, tenant=TenantTag("decode"))
        for _ in range(2):  # the decodes' prompts, then one decode step as warm-up
            engine.step()
        one = SamplingParams(max_tokens=1)
        k = 0
        for _ in range(reps):
            for size in sizes:
                if size:
                    engine.add_request(f"p{k}", prompt(size), one, tenant=TenantTag("p"))
                    k += 1
                began = time.perf_counter()
                engine.step()
                times[size].append((time.perf_counter() - began) * 1000)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--decodes", type=int, default=16, help="requests decoding each step")
    parser.add_argument("--sizes", default="0,16,64,128,256,512,1024,2048")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if not sizes or sizes[0] < 0 or args.decodes < 0 or args.reps < 1:
        parser.error("--sizes must be non-negative integers, --decodes >= 0, --reps >= 1")
    times = measure(args.model, args.decodes, sizes, args.reps)
    base = min(times[0]) if 0 in times else None
    rows = []
    for size in sizes:
        least, median = min(times[size]), statistics.median(times[size])
        per_token = (least - base) / size if base is not None and size else None
        rows.append({"prefill_tokens": size, "median_ms": median, "least_ms": least,
                     "ms_per_prefill_token": per_token})  # fmt: skip
        extra = f", {per_token:.2f} ms per prefill token" if per_token is not None else ""
        print(f"{args.decodes} decodes + {size:5d} prefill tokens: median {median:7.1f} ms, "
              f"least {least:7.1f} ms{extra}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"decodes": args.decodes, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
