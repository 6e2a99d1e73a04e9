"""``portico bench``: the benchmarks, from the command line."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    serve = sub.add_parser("serve", help="replay a workload against an OpenAI-compatible URL")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    serve.add_argument("--model", required=True)
    serve.add_argument("--api-key", default=None)
    serve.add_argument(
        "--dataset",
        choices=["synthetic", "sharegpt", "shared-prefix", "random-image"],
        default="synthetic",
        help="random-image: chat requests with random PNG pictures (--images-per-request, "
        "--image-size) and --prompt-len random words of text",
    )
    serve.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    serve.add_argument(
        "--images-per-request",
        type=int,
        default=1,
        help="random-image: pictures per request (0: the same texts without pictures)",
    )
    serve.add_argument(
        "--image-size",
        type=int,
        nargs=2,
        default=(224, 224),
        metavar=("MIN", "MAX"),
        help="random-image: each picture's width and height in pixels, drawn from MIN-MAX",
    )
    serve.add_argument("--num-requests", type=int, default=64)
    serve.add_argument("--prompt-len", type=int, nargs=2, default=(16, 600), metavar=("MIN", "MAX"))
    serve.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    serve.add_argument("--request-rate", type=float, default=float("inf"))
    serve.add_argument("--burstiness", type=float, default=1.0)
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--ttft-slo-ms", type=float, default=None)
    serve.add_argument("--tpot-slo-ms", type=float, default=None)
    serve.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject vLLM's extras)",
    )
    serve.add_argument("--out", default="load/results/serve.json")
    serve.add_argument("--plot", default=None, help="PNG path for the latency CDFs")

    for name, module, help_text in _delegated():
        # prefix_chars="+": every argument, "--help" and "--quick" first included, is handed
        # to the benchmark's own parser (argparse's REMAINDER refuses a leading option).
        p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="+")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(_module=module)


def _delegated() -> list[tuple[str, str, str]]:
    """Benchmarks with their own argument parsers, listed only when their module exists."""
    candidates = [
        ("engine", "load.engine_bench", "offline engine vs transformers static batching"),
        ("gateway", "load.gateway_bench", "gateway overhead vs direct, rate-limit correctness"),
        ("remote", "load.remote_bench", "engine tier vs OpenAI-compatible remote vs litellm"),
        ("admission", "load.admission_bench", "admission cost per request (Redis Lua)"),
        ("soak", "load.soak", "mixed traffic for a while, gateway memory over time"),
        ("standard", "load.standard", "everything `make bench` runs"),
        ("fairness", "load.fairness_bench", "a quiet tenant next to a noisy one, fcfs vs fair"),
        ("fairness-steps", "load.fairness_steps", "the fairness workload in scheduler steps"),
        ("fleet", "load.fleet_bench", "replica choice: prefix_aware, least_loaded, round_robin"),
        ("gpu", "load.gpu_bench", "the engine on CUDA: kernels, greedy, throughput, bandwidth"),
        ("batch", "load.batch_bench", "interactive TTFT with a batch running vs without"),
        (
            "fresh-clone",
            "load.fresh_clone_bench",
            "a fresh clone's make run vs the no-flags engine",
        ),
    ]
    return [c for c in candidates if importlib.util.find_spec(c[1]) is not None]


def _workload(args: argparse.Namespace) -> list[Any] | None:
    """``portico bench serve``'s requests, or None after printing why there are none."""
    from load import datasets

    if args.dataset == "synthetic":
        return datasets.synthetic(
            args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed
        )
    if args.dataset == "shared-prefix":
        groups = max(1, args.num_requests // 8)
        return datasets.shared_prefix(num_groups=groups, seed=args.seed)[: args.num_requests]
    if args.dataset == "random-image":
        try:
            return datasets.random_images(
                args.num_requests, args.images_per_request, tuple(args.image_size),
                tuple(args.prompt_len), tuple(args.output_len), args.seed,
            )  # fmt: skip
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return None
    if not args.dataset_path:
        print("error: --dataset sharegpt needs --dataset-path", file=sys.stderr)
        return None
    return datasets.sharegpt(args.dataset_path, args.num_requests, args.seed)


def run(args: argparse.Namespace) -> int:
    if args.bench_command != "serve":
        module = importlib.import_module(args._module)
        return int(module.main(args.rest) or 0)
    from load import serve_bench

    reqs = _workload(args)
    if reqs is None:
        return 2
    extra = {} if args.no_ignore_eos else {"ignore_eos": True}
    summary, results = asyncio.run(
        serve_bench.run_benchmark(
            args.base_url,
            args.model,
            reqs,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            api_key=args.api_key,
            extra_body=extra,
            seed=args.seed,
            ttft_slo_ms=args.ttft_slo_ms,
            tpot_slo_ms=args.tpot_slo_ms,
        )
    )
    serve_bench.write_results(args.out, summary, results)
    if args.plot:
        from load.report import plot_latency_cdfs

        plot_latency_cdfs({args.model: results}, args.plot)
    brief = {k: v for k, v in summary.items() if not isinstance(v, (dict, list))}
    print(
        json.dumps(brief | {"ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"]}, indent=2)
    )
    return 0 if summary["failed"] == 0 else 1
