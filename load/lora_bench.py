"""Multi-LoRA throughput: the same requests on the base model and spread over adapters.

    python -m load.lora_bench                          # smollm2-135m, 4 adapters, rank 16
    python -m load.lora_bench --num-requests 32 --rounds 1   # a quick look

One engine (``--enable-lora``, ``--max-loras`` = the number of adapters) serves both halves,
in the same process, alternating rounds (base, adapters, base, adapters, ...) so that a machine
shared with other work slows both alike. Each round runs the same ``--num-requests`` requests
(fixed seed: random token prompts, EOS ignored, so every round produces exactly the same number
of tokens) closed-loop at ``--concurrency``: a new request starts whenever one finishes. In the
adapter rounds request ``i`` names adapter ``i % num_adapters``, so every step mixes them.
The adapters are written at startup in PEFT's format with random A and B (rank ``--rank``, all
seven projections). Prefix caching is off: a round must not hit the cache of the one before.
Reported: output tokens/s of each half (summed over its rounds), the ratio of each pair of
neighbouring rounds (equal tokens, so base time / adapter time) and their median. A benchmark,
never a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.lora.adapter import PROJECTIONS, module_shapes
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams

TARGET_RATIO = 0.70


def write_random_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT adapter folder with random A and B on every projection of every layer."""
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (module, part) in PROJECTIONS.items():
            in_features, outs = shapes[module]
            block = "self_attn" if module in ("qkv_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(outs[part], rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(PROJECTIONS)}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def run_round(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_lens: list[int],
    loras: list[LoRARequest | None],
    concurrency: int,
) -> dict[str, Any]:
    """Closed loop: keep ``concurrency`` requests in flight until all are done."""
    pending = list(range(len(prompts)))[::-1]
    in_flight = 0
    produced = 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i = pending.pop()
            params = SamplingParams(temperature=0.0, max_tokens=output_lens[i], ignore_eos=True)
            engine.add_request(f"r{i}-{time.perf_counter_ns()}", prompts[i], params,
                               lora_request=loras[i % len(loras)])  # fmt: skip
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                produced += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    if produced != sum(output_lens):
        raise RuntimeError(f"produced {produced} tokens, expected {sum(output_lens)}")
    return {"elapsed_s": round(elapsed, 3), "output_tokens": produced}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF folder or .gguf")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64, help="per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each half")
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--output", default=".portico/bench/lora_bench.json")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="portico-lora-bench-") as tmp:
        base = EngineConfig(model=args.model, device=args.device, dtype=args.dtype)
        probe = LLMEngine.from_config(base)  # for the model's shapes; replaced below
        cfg = probe.model_config
        del probe
        folders = [
            write_random_adapter(Path(tmp) / f"adapter{k}", cfg, args.rank, seed=k)
            for k in range(args.num_adapters)
        ]
        config = EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype,
            enable_prefix_caching=False, max_num_seqs=max(args.concurrency, 1),
            enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
            lora_modules=tuple(f"adapter{k}={f}" for k, f in enumerate(folders)),
        )  # fmt: skip
        engine = LLMEngine.from_config(config)
        assert engine.lora is not None
        adapters: list[LoRARequest | None] = [
            engine.lora.get(f"adapter{k}") for k in range(args.num_adapters)
        ]
        rng = random.Random(args.seed)
        vocab = engine.vocab_size
        prompts = [
            [
                rng.randrange(1000, vocab)
                for _ in range(rng.randint(args.min_prompt, args.max_prompt))
            ]
            for _ in range(args.num_requests)
        ]
        output_lens = [rng.randint(args.min_output, args.max_output) for _ in prompts]
        run_round(engine, prompts[:4], [4] * 4, [None, *adapters], args.concurrency)  # warm-up
        rounds: dict[str, list[dict[str, Any]]] = {"base": [], "lora": []}
        for _ in range(args.rounds):
            for half, loras in (("base", [None]), ("lora", adapters)):
                result = run_round(engine, prompts, output_lens, loras, args.concurrency)
                rounds[half].append(result)
                print(f"{half}: {result}", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    for half, results in rounds.items():
        tokens = sum(r["output_tokens"] for r in results)
        seconds = sum(r["elapsed_s"] for r in results)
        summary[f"{half}_output_tokens_per_s"] = round(tokens / seconds, 2)
    # The ratio of each (base, adapters) pair of neighbouring rounds, then their median: a
    # shared machine's load can change a lot between pairs, much less within one.
    pair_ratios = sorted(
        b["elapsed_s"] / a["elapsed_s"] for b, a in zip(rounds["base"], rounds["lora"], strict=True)
    )
    ratio = pair_ratios[len(pair_ratios) // 2]
    report = {
        "benchmark": "lora_bench",
        "command": " ".join(["python -m load.lora_bench", *sys.argv[1:]]),
        "model": args.model,
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "concurrency": args.concurrency,
        "num_requests_per_round": args.num_requests,
        "rounds": rounds,
        **summary,
        "pair_ratios": [round(r, 3) for r in pair_ratios],
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load.lora_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
