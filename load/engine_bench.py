"""Offline engine throughput against Hugging Face transformers, same prompts, same machine.

    python -m load.engine_bench                       # 256 requests, the full workload
    python -m load.engine_bench --num-requests 32     # a quick look
    python -m load.engine_bench --device cpu --dtype float32 --max-output 64

Workload (fixed seed): ``--num-requests`` prompts of random token ids, lengths uniform in
[``--min-prompt``, ``--max-prompt``], each asking for a length uniform in
[``--min-output``, ``--max-output``] with EOS ignored, so both systems produce exactly the same
number of tokens. Portico runs them all through ``LLM.generate`` (continuous batching, paged
KV); transformers runs ``generate`` on static batches of ``--hf-batch-size`` in arrival order
(left-padded, each batch decoding to its longest request). Reported: output tokens/s of both,
the speedup, and single-stream decode tokens/s (one request, time between its first and last
token). Results go to ``--output`` as JSON. This is a benchmark, never a test: numbers depend
on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import QUANTIZATIONS, EngineConfig
from engine.kernels import cpu as cpu_kernels
from engine.kv_cache_dtype import KV_CACHE_DTYPES
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_loader import choose_device, choose_dtype, load_model
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource, resolve

TARGET_SPEEDUP = 3.0
TARGET_SINGLE_STREAM = 50.0


@dataclass(frozen=True)
class Workload:
    """The prompts (token ids) and the number of tokens each must produce."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    low_token = min(1000, vocab_size // 2)  # clear of special and byte tokens
    prompts, outputs = [], []
    for _ in range(args.num_requests):
        n = rng.randint(args.min_prompt, args.max_prompt)
        prompts.append([rng.randrange(low_token, vocab_size) for _ in range(n)])
        outputs.append(rng.randint(args.min_output, args.max_output))
    return Workload(prompts, outputs)


def run_portico(engine: LLMEngine, work: Workload) -> dict[str, Any]:
    llm = LLM.from_engine(engine)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]  # fmt: skip
    before = engine.stats()
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != work.num_output_tokens:
        raise RuntimeError(f"portico produced {produced} tokens, expected {work.num_output_tokens}")
    ttfts = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs
                   if o.metrics.first_token_time is not None)  # fmt: skip
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(produced / elapsed, 2),
        "total_tokens_per_s": round((produced + work.num_prompt_tokens) / elapsed, 2),
        "num_steps": after.num_steps - before.num_steps,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "median_ttft_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
    }


def single_stream(engine: LLMEngine, prompt: list[int], num_tokens: int) -> dict[str, Any]:
    out = LLM.from_engine(engine).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    )[0]
    m = out.metrics
    assert m.first_token_time is not None and m.last_token_time is not None
    decode_s = m.last_token_time - m.first_token_time
    return {
        "prompt_tokens": len(prompt),
        "output_tokens": num_tokens,
        "ttft_s": round(m.first_token_time - m.arrival_time, 4),
        "decode_tokens_per_s": round((num_tokens - 1) / decode_s, 2),
    }


def load_hf(source: ModelSource, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any
    if source.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    return model.to(device).eval()


def run_hf(model: Any, work: Workload, batch_size: int, pad_id: int) -> dict[str, Any]:
    device = next(model.parameters()).device
    start = time.perf_counter()
    for first in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[first : first + batch_size]
        new_tokens = max(work.output_lens[first : first + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(work.num_output_tokens / elapsed, 2),
        "total_tokens_per_s": round((work.num_output_tokens + work.num_prompt_tokens) / elapsed, 2),
        "batch_size": batch_size,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF folder or .gguf")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: a GGUF model on CPU runs small batches on its own blocks",
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=600)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="2GiB", help="KV budget on CPU")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="launch step N+1 before reading step N's tokens")  # fmt: skip
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size")
    parser.add_argument("--single-stream-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true", help="only measure Portico")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--output", default=".portico/bench/engine_bench.json")


def _engine_config(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> EngineConfig:
    """The engine the bench's flags describe."""
    return EngineConfig(
        model=args.model,
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    source = resolve(args.model)
    config = _engine_config(args, device, dtype)
    engine = LLMEngine(
        config,
        load_model(source, dtype, device, args.quantization, config.gguf_activations),
    )
    work = make_workload(args, engine.vocab_size)
    print(
        f"workload: {len(work.prompts)} requests, {work.num_prompt_tokens} prompt tokens, "
        f"{work.num_output_tokens} output tokens; {device.type} {dtype}",
        file=sys.stderr,
    )
    # Warm-up and single-stream prompts are drawn apart from the workload: no cache hits.
    rng = random.Random(args.seed + 1)
    warm = Workload([[rng.randrange(1000, engine.vocab_size) for _ in range(24)] for _ in "ab"],
                    [4, 4])  # fmt: skip
    run_portico(engine, warm)
    solo = [rng.randrange(1000, engine.vocab_size) for _ in range(16)]
    single = single_stream(engine, solo, args.single_stream_tokens)
    print(f"single stream: {single['decode_tokens_per_s']} tok/s", file=sys.stderr)
    portico = run_portico(engine, work)
    print(f"portico: {portico['output_tokens_per_s']} output tok/s", file=sys.stderr)
    result: dict[str, Any] = {
        "model": source.name,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "cpu_kernels": cpu_kernels.available(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "workload": {
            "num_requests": len(work.prompts),
            "prompt_len": [args.min_prompt, args.max_prompt],
            "output_len": [args.min_output, args.max_output],
            "num_prompt_tokens": work.num_prompt_tokens,
            "num_output_tokens": work.num_output_tokens,
            "seed": args.seed,
        },
        "engine_config": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enforce_eager": args.enforce_eager,
            "async_scheduling": args.async_scheduling,
        },  # fmt: skip
        "portico": portico,
        "single_stream": single,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")  # kept if the baseline is interrupted
    if not args.skip_hf:
        del engine
        hf_model = load_hf(source, dtype, device)
        run_hf(hf_model, warm, 2, pad_id=0)
        hf = run_hf(hf_model, work, args.hf_batch_size, pad_id=0)
        print(f"transformers: {hf['output_tokens_per_s']} output tok/s", file=sys.stderr)
        result["transformers"] = hf
        result["speedup"] = round(portico["output_tokens_per_s"] / hf["output_tokens_per_s"], 2)
    result["targets"] = {
        "speedup_at_least_3x": result.get("speedup", 0.0) >= TARGET_SPEEDUP,
        "single_stream_at_least_50_tok_s": single["decode_tokens_per_s"] >= TARGET_SINGLE_STREAM,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load.engine_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
