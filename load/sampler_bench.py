"""Time one sampler step: ``python -m load.sampler_bench [--device cpu|cuda]``.

Rows with every kind of processing (temperature 0.8, top-p 0.9, repetition penalty 1.1,
frequency penalty 0.2, 5 logprobs; prompts of 200 tokens, 50 output tokens each), seeded or
not, over a vocabulary of 49,152 (SmolLM2's). Prints the median milliseconds of 15 steps for
1 and 64 rows. Run the same file with ``PYTHONPATH`` at another checkout to compare samplers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

VOCAB = 49152


def make_rows(n: int, seeded: bool) -> list[Request]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        params = SamplingParams(
            temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.2,
            seed=i if seeded else None, logprobs=5,
        )  # fmt: skip
        req = Request(str(i), [rng.randrange(VOCAB) for _ in range(200)], params)
        for _ in range(50):
            req.append_output_token(rng.randrange(VOCAB))
        rows.append(req)
    return rows


def time_step(rows: list[Request], device: str, iters: int = 15) -> float:
    """Median milliseconds of one ``Sampler.sample`` over ``rows`` (ids read back included)."""
    sampler = Sampler([2], seed=0)
    base = torch.randn(len(rows), VOCAB, device=device)
    times = []
    for _ in range(iters):
        logits = base.clone()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        sampler.sample(logits, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    for n in (1, 64):
        for seeded in (False, True):
            ms = time_step(make_rows(n, seeded), args.device)
            print(json.dumps({"rows": n, "seeded": seeded, "device": args.device, "ms": ms}))


if __name__ == "__main__":
    main()
