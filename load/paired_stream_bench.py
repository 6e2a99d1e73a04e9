"""One stream against two running servers, request by request: ``python -m load.paired_stream_bench
URL_A URL_B``.

On a shared 2-core VM a served one-stream figure moves by 5-10% from one run to the next, more
than most changes make, and two runs one after the other also see the machine change between
them. This bench sends each prompt to both servers back to back (A then B, then B then A for the
next prompt, so neither always goes first), one request at a time, streamed, greedy, with a
forced output length, and reports each server's medians and the median of the paired ratios
B / A for the time to first token, the time per output token and the whole request (sent to
last chunk: with the same tokens out, B / A of it is A's one-stream throughput over B's). Each
prompt is new to both servers (random token ids), so neither answers from its prefix cache.
Any server of OpenAI's ``/v1/completions`` that takes token ids as the prompt and honours
``ignore_eos`` serves as either side: llama.cpp's ``llama-server`` with one slot does.

    portico engine --port 8101 ...          # tree A (e.g. a worktree of the base revision)
    portico engine --port 8102 ...          # tree B
    python -m load.paired_stream_bench http://127.0.0.1:8101 http://127.0.0.1:8102 \\
        --requests 24 --prompt-len 22,300 --output-len 64
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx


@dataclass
class Timings:
    """One server's per-request times, in seconds."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    request: list[float] = field(default_factory=list)  # from sending to the last chunk


def prompts(count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """``count`` prompts of random token ids (100..39,999), lengths uniform in the range."""
    rng = random.Random(seed)
    return [
        [rng.randrange(100, 40000) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(count)
    ]


def stream_once(
    client: httpx.Client,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    new_connection: bool = False,
) -> tuple[float, float, float]:
    """One streamed completion; (time to its first chunk, mean time between later chunks, time
    to its last chunk)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    started = time.perf_counter()
    arrivals: list[float] = []
    headers = {"connection": "close"} if new_connection else None
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    if len(arrivals) < 2:
        raise RuntimeError(f"{url} streamed {len(arrivals)} chunks; need at least 2")
    return (
        arrivals[0] - started,
        (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1),
        arrivals[-1] - started,
    )


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of b[i] / a[i]."""
    return statistics.median(y / x for x, y in zip(a, b, strict=True))


def run(
    url_a: str,
    url_b: str,
    model: str,
    all_prompts: list[list[int]],
    output_len: int,
    new_connection: bool = False,
) -> tuple[Timings, Timings]:
    """Every prompt to both servers, alternating which goes first (each request on a connection
    of its own with ``new_connection``)."""
    timings = {url_a: Timings(), url_b: Timings()}
    with httpx.Client(timeout=600) as client:
        for i, prompt in enumerate(all_prompts):
            for url in (url_a, url_b) if i % 2 == 0 else (url_b, url_a):
                ttft, tpot, whole = stream_once(
                    client, url, model, prompt, output_len, new_connection
                )
                timings[url].ttft.append(ttft)
                timings[url].tpot.append(tpot)
                timings[url].request.append(whole)
    return timings[url_a], timings[url_b]


def report(a: Timings, b: Timings) -> str:
    lines = []
    for name in ("ttft", "tpot", "request"):
        ta, tb = getattr(a, name), getattr(b, name)
        lines.append(
            f"{name}: A median {statistics.median(ta) * 1e3:.2f} ms, B median "
            f"{statistics.median(tb) * 1e3:.2f} ms, B / A paired median {paired_ratio(ta, tb):.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url_a")
    parser.add_argument("url_b")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=24, help="prompts, each sent to both")
    parser.add_argument("--prompt-len", default="22,300", help="MIN,MAX prompt tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--new-connection",
        action="store_true",
        help="a connection per request on both sides (llama-server drops reused ones)",
    )
    args = parser.parse_args(argv)
    low, high = (int(v) for v in args.prompt_len.split(","))
    if not 1 <= low <= high or args.requests < 1 or args.output_len < 2:
        parser.error("need 1 <= MIN <= MAX, --requests >= 1 and --output-len >= 2")
    a, b = run(args.url_a, args.url_b, args.model, prompts(args.requests, low, high, args.seed),
               args.output_len, args.new_connection)  # fmt: skip
    print(report(a, b))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
