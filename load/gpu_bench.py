"""``portico bench gpu``: the engine on a CUDA card, checked and measured in one command.

    portico bench gpu --out load/results/gpu.json --plot load/results/gpu.png

Eight sections, in order, each within its share of a 6-minute budget (one H200):

(a) kernels: the Triton paged attention and KV-cache write against the PyTorch references at
    real shapes (the default model's, a 1B-class, an 8B-class), float32 and bf16, bf16 and
    int8 caches, one step mixing decodes at long contexts with prefill chunks;
(b) greedy: the engine's greedy tokens against transformers' on the same device in float32,
    with the prefix cache hit; the real default model where its file is present, else random
    weights saved once to a folder both sides load;
(c) offline: the engine's throughput against transformers' static batches (and its static
    cache under torch.compile where that works), the default model's shape, bf16, dummy
    weights (``--load-format dummy``);
(d) served: ``portico engine`` with dummy weights at concurrency 1, 64 and 256 (TTFT, TPOT),
    through load/serve_bench.py;
(e) bandwidth: the card's measured copy bandwidth; the decode attention kernel's GB/s and a
    decode step's least bytes, for the default model's shape and a 1B-class shape;
(f) fp8: ``--quantization fp8`` against bf16 on the 1B-class shape (dummy weights): one
    stream's decode tok/s and 64 requests at once (issue 41: fp8 >= 1.5x bf16 at c=64);
(g) async: ``--async-scheduling`` against synchronous steps on the default model's shape
    (dummy weights, bf16, graphs on): one stream's decode tok/s and 64 requests at once;
(h) invariant: ``--batch-invariant`` against the default on the default model's shape (what
    it costs at one stream and at 64), and under each whether one prompt's greedy tokens are
    the same alone and inside a batch of 16.

Refuses without CUDA. The pure parts (shapes, byte accounting, report) are load/gpu_shapes.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from load.gpu_engine_pairs import async_section, fp8_section, free_cuda, invariant_section
from load.gpu_shapes import (
    SECTIONS,
    SHAPES,
    Shape,
    bandwidth_row,
    build_report,
    kernel_verdict,
    summary_lines,
    write_shape_folder,
)

BUDGET_S = 330.0  # the whole run, leaving 30 s of the 6 minutes for start-up and the plot
# (query_len, seq_len) of one kernel step: decodes at long contexts and prefill chunks
KERNEL_STEP = [(1, 4000), (1, 1500), (1, 17), (1, 900), (256, 256), (64, 2100), (7, 7)]
SERVED_LEVELS = {1: 8, 64: 256, 256: 512}  # concurrency -> requests
OFFLINE_REQUESTS, OFFLINE_OUTPUT = 256, 128


class Budget:
    """Seconds left of the run; a section that needs more than is left is skipped."""

    def __init__(self, total_s: float) -> None:
        self.deadline = time.monotonic() + total_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _sync_time(fn: Callable[[], object], repeats: int, device: str = "cuda") -> float:
    """Median seconds of ``fn`` on the device (CUDA events; on a CPU the wall clock), after
    two warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    times = []
    if device == "cpu":
        for _ in range(repeats):
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
        return sorted(times)[len(times) // 2]
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


# --------------------------------------------------------------------------- (a) kernels


def kernel_case(
    shape: Shape,
    dtype: Any,
    kv: str,
    seed: int,
    device: str = "cuda",
    step: list[tuple[int, int]] = KERNEL_STEP,
) -> dict[str, Any]:
    """One step of ``step``'s (query_len, seq_len) at ``shape``: the Triton writer's cache
    against the reference writer's, the Triton attention against the reference's on the same
    cache (``device`` cpu: under TRITON_INTERPRET=1, the tests' way)."""
    import torch

    from engine.attention import AttentionMetadata
    from engine.kernels.reference import paged_attention_ref, write_kv_cache_ref
    from engine.kernels.triton_kv_cache_write import write_kv_cache_triton
    from engine.kernels.triton_paged_attention import paged_attention_triton
    from engine.kv_cache_dtype import cache_shape

    torch.manual_seed(seed)
    rng, block, dev = random.Random(seed), 16, torch.device(device)
    heads, kv_heads, d = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    q_lens, s_lens = [q for q, _ in step], [s for _, s in step]
    needed = [-(-s // block) for s in s_lens]
    pool = list(range(1, sum(needed) + 1))
    rng.shuffle(pool)  # scattered blocks; block 0 unused
    tables = [pool[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(needed))]
    num_blocks = len(pool) + 1
    cache_dtype = torch.int8 if kv == "int8" else dtype
    ref_cache = torch.zeros(cache_shape(cache_dtype, num_blocks, block, kv_heads, d),
                            dtype=cache_dtype, device=dev)  # fmt: skip
    everything = AttentionMetadata.build([num_blocks * block], [num_blocks * block],
                                         [list(range(num_blocks))], block, dev)  # fmt: skip
    old = torch.randn(2, num_blocks * block, kv_heads, d, device=dev).to(dtype)
    write_kv_cache_ref(old[0], old[1], ref_cache, everything.slot_mapping)
    tri_cache = ref_cache.clone()
    meta = AttentionMetadata.build(q_lens, s_lens, tables, block, dev)
    tokens = sum(q_lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=dev).to(dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    write_kv_cache_ref(k, v, ref_cache, meta.slot_mapping)
    write_kv_cache_triton(k, v, tri_cache, meta.slot_mapping)
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, d**-0.5,
            meta.query_lens_cpu, meta.seq_lens_cpu)  # fmt: skip
    out_ref = paged_attention_ref(q, ref_cache, *args)
    out_tri = paged_attention_triton(q, ref_cache, *args)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    diff = float((out_ref.float() - out_tri.float()).abs().max())
    equal = bool(torch.equal(ref_cache, tri_cache))
    name = str(dtype).removeprefix("torch.")
    return {"shape": shape.name, "dtype": name, "kv": kv, "attn_diff": diff,
            "cache_equal": equal, "ok": kernel_verdict(name, diff, equal)}  # fmt: skip


def kernels_section(budget: Budget) -> dict[str, Any]:
    import torch

    cases = []
    for i, shape in enumerate(SHAPES.values()):
        for dtype in (torch.float32, torch.bfloat16):
            for kv in ("auto", "int8"):
                cases.append(kernel_case(shape, dtype, kv, seed=i))
    free_cuda()
    return {"step": KERNEL_STEP, "cases": cases}


# --------------------------------------------------------------------------- (b) greedy


def _random_checkpoint(folder: Path, shape: Shape, seed: int = 0) -> Path:
    """``shape`` with random float32 weights saved as safetensors, for both sides to load:
    matrices of std 1/sqrt(fan-in) and an embedding of std 1, so greedy choices have clear
    winners rather than the near-ties of tiny initial weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    write_shape_folder(folder, shape)
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(LlamaConfig(**shape.hf_config()))
    model = model.to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def greedy_section(
    workdir: Path,
    new_tokens: int = 32,
    device: str = "cuda",
    shape: Shape = SHAPES["smollm2-135m"],
    real_model: bool = True,
) -> dict[str, Any]:
    """16 prompts (8 sharing a 48-token prefix, so the cache hits), greedy, float32: the
    engine's tokens (prefix caching on, and off) and transformers' on ``device``, from the
    default model's file where ``real_model`` and present, else from
    :func:`_random_checkpoint` of ``shape``."""
    import torch

    from load.engine_bench import load_hf
    from portico.registry import DEFAULT_MODEL, ModelNotFound, resolve

    try:
        if not real_model:
            raise ModelNotFound(DEFAULT_MODEL)
        source, label = resolve(DEFAULT_MODEL), f"{DEFAULT_MODEL} (its GGUF)"
    except ModelNotFound:
        folder = _random_checkpoint(workdir / "greedy-checkpoint", shape)
        source, label = resolve(str(folder)), f"{shape.name} shape, random weights"
    rng, top = random.Random(0), min(40000, shape.vocab_size)
    shared = [rng.randrange(100, top) for _ in range(48)]  # three full blocks
    prompts = [[rng.randrange(100, top) for _ in range(rng.randint(8, 90))] for _ in range(8)]
    prompts += [shared + [rng.randrange(100, top) for _ in range(5 + i)] for i in range(8)]
    ours, cached = _engine_greedy(str(source.path), device, prompts, new_tokens, True)
    ours_uncached, _ = _engine_greedy(str(source.path), device, prompts, new_tokens, False)
    model = load_hf(source, torch.float32, torch.device(device))
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens)  # fmt: skip
            theirs.append(out[0, len(p) :].tolist())
    del model
    free_cuda()
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
    equal_off = sum(a == b for a, b in zip(ours_uncached, theirs, strict=True))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                  for a, b in zip(ours, theirs, strict=True)]  # fmt: skip
    return {"model": label, "prompts": len(prompts), "equal": equal, "new_tokens": new_tokens,
            "equal_prefix_caching_off": equal_off,
            "prefix_cached_tokens": cached, "first_difference": first_diff}  # fmt: skip


def _engine_greedy(
    model: str, device: str, prompts: list[list[int]], new_tokens: int, prefix_caching: bool
) -> tuple[list[list[int]], int]:
    """The engine's greedy tokens for ``prompts`` in float32, and the prompt tokens its
    prefix cache served: the first nine prompts, then the rest (the 9th caches the prefix
    the 7 after it share)."""
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    config = EngineConfig(model=model, device=device, dtype="float32",
                          enable_prefix_caching=prefix_caching,
                          gpu_memory_utilization=0.3)  # fmt: skip
    engine = LLMEngine.from_config(config)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm = LLM.from_engine(engine)
    outs = llm.generate(prompts[:9], greedy) + llm.generate(prompts[9:], greedy)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    cached = sum(o.num_cached_tokens for o in outs)
    engine.close()
    del engine, llm, outs
    free_cuda()
    return tokens, cached


# --------------------------------------------------------------------------- (c) offline


def offline_section(
    budget: Budget,
    folder: Path,
    compile_hf: bool,
    device: str = "cuda",
    shape: str = "smollm2-135m",
) -> dict[str, Any]:
    """The engine (``--load-format dummy`` on ``folder``, ``shape``'s config) against
    transformers' static batches of the same shape and random weights, bf16 on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from load.engine_bench import Workload, run_hf, run_portico, single_stream

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randint(64, 512))]
               for _ in range(OFFLINE_REQUESTS)]  # fmt: skip
    work = Workload(prompts, [OFFLINE_OUTPUT] * OFFLINE_REQUESTS)
    config = EngineConfig(model=str(folder), device=device, load_format="dummy", dtype="bfloat16",
                          max_num_seqs=256, gpu_memory_utilization=0.4)  # fmt: skip
    engine = LLMEngine.from_config(config)
    warm = [[999 - i] * 64 for i in range(8)]  # prompts the workload never shares a block with
    run_portico(engine, Workload(warm, [8] * 8))  # warm-up: Triton compiles
    runs: dict[str, Any] = {"portico": run_portico(engine, work)}
    runs["portico_single_stream"] = single_stream(engine, work.prompts[0], 128)
    engine.close()
    del engine
    free_cuda()
    hf_config = LlamaConfig(**SHAPES[shape].hf_config())
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).to(device).eval()
    run_hf(model, Workload(work.prompts[:2], [4, 4]), 2, 0)  # warm-up
    runs["transformers_static_batch_64"] = run_hf(model, work, 64, 0)
    if compile_hf and budget.left() > 150:
        runs["transformers_static_cache_compiled"] = _compiled_hf(model, work)
    del model
    free_cuda()
    speedup = runs["portico"]["output_tokens_per_s"] / max(
        runs["transformers_static_batch_64"]["output_tokens_per_s"], 1e-9
    )
    return {"shape": shape, "dtype": "bfloat16", "requests": OFFLINE_REQUESTS,
            "output_tokens": OFFLINE_OUTPUT, "runs": runs,
            "speedup_vs_static_batch": round(speedup, 2)}  # fmt: skip


def _compiled_hf(model: Any, work: Any) -> dict[str, Any]:
    """transformers' static KV cache with the forward under torch.compile, where it works
    (a failure is reported, not raised): two batches of 64, after one to compile."""
    import torch

    from load.engine_bench import Workload, run_hf

    try:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        head = Workload(work.prompts[:64], work.output_lens[:64])
        run_hf(model, head, 64, 0)  # compiles
        part = Workload(work.prompts[64:192], work.output_lens[64:192])
        return run_hf(model, part, 64, 0)
    except Exception as exc:  # any compile failure is a result here
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "output_tokens_per_s": 0}


# --------------------------------------------------------------------------- (d) served


def served_section(
    budget: Budget, folder: Path, workdir: Path, device: str = "cuda"
) -> dict[str, Any]:
    """``portico engine`` (dummy weights, bf16) at each concurrency of :data:`SERVED_LEVELS`,
    prompts of 64-512 token ids and 128 output tokens, through load/serve_bench.py."""
    from load.datasets import synthetic
    from load.fairness_bench import SERVED_NAME, engine_process
    from load.serve_bench import run_benchmark

    flags = ["--device", device, "--load-format", "dummy", "--dtype", "bfloat16",
             "--max-num-seqs", "256", "--gpu-memory-utilization", "0.5"]  # fmt: skip
    levels: dict[str, Any] = {}
    with engine_process(str(folder), "fcfs", flags, workdir) as url:
        warm = synthetic(4, (64, 64), (8, 8), seed=99)  # no level uses seed 99
        asyncio.run(run_benchmark(url + "/v1", SERVED_NAME, warm, max_concurrency=4,
                                  extra_body={"ignore_eos": True}, progress=False))  # fmt: skip
        for concurrency, count in SERVED_LEVELS.items():
            if budget.left() < 30:
                levels[str(concurrency)] = {"skipped": "time budget"}
                continue
            reqs = synthetic(count, (64, 512), (128, 128), seed=concurrency)
            summary, _ = asyncio.run(run_benchmark(
                url + "/v1", SERVED_NAME, reqs, max_concurrency=concurrency,
                extra_body={"ignore_eos": True}, progress=False,
            ))  # fmt: skip
            levels[str(concurrency)] = {k: summary[k] for k in (
                "completed", "failed", "output_throughput", "ttft_ms", "tpot_ms", "duration_s",
            ) if k in summary}  # fmt: skip
    return {"shape": "smollm2-135m", "dtype": "bfloat16", "flags": flags, "levels": levels}


# --------------------------------------------------------------------------- (e) bandwidth


def copy_bandwidth_gbs(megabytes: int = 2048) -> float:
    """The card's device-to-device copy rate: bytes read plus bytes written, per second."""
    import torch

    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _sync_time(lambda: dst.copy_(src), 10)
    return round(2 * megabytes * 2**20 / seconds / 1e9, 1)


def attention_seconds(shape: Shape, batch: int, context: int, device: str = "cuda") -> float:
    """One layer's decode attention (Triton, bf16 cache) for ``batch`` sequences (``device``
    cpu: under TRITON_INTERPRET=1, for the tests)."""
    import torch

    from engine.attention import AttentionMetadata
    from engine.kernels.triton_paged_attention import paged_attention_triton

    block = 16
    per_seq = -(-context // block)
    order = torch.randperm(batch * per_seq).add(1).tolist()  # scattered blocks
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, block, device)
    kv, d = shape.num_key_value_heads, shape.head_dim
    cache = torch.randn(2, batch * per_seq + 1, block, kv, d, device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, shape.num_attention_heads, d, device=device, dtype=torch.bfloat16)
    args = (q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, d**-0.5,
            meta.query_lens_cpu, meta.seq_lens_cpu)  # fmt: skip
    return _sync_time(lambda: paged_attention_triton(*args), 20, device)


def bandwidth_section(budget: Budget, served: dict[str, Any]) -> dict[str, Any]:
    copy = copy_bandwidth_gbs()
    tpot = served.get("levels", {}).get("64", {}).get("tpot_ms", {}).get("median")
    rows = []
    for name in ("smollm2-135m", "llama-1b"):
        for batch, context in ((1, 2048), (64, 1024), (256, 512)):
            seconds = attention_seconds(SHAPES[name], batch, context)
            measured = tpot if (name, batch) == ("smollm2-135m", 64) else None
            rows.append(bandwidth_row(SHAPES[name], batch, context, seconds, copy, measured))
    free_cuda()
    return {"copy_gbs": copy, "dtype": "bfloat16", "rows": rows}


# --------------------------------------------------------------------------- report


def plot(report: dict[str, Any], path: Path) -> Path:
    """Throughput (offline and served) and attention GB/s against the copy bandwidth."""
    from load.report import _pyplot, _save

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    s = report["sections"]
    bars = {name: run.get("output_tokens_per_s", 0) for name, run in
            s["offline"].get("runs", {}).items() if "output_tokens_per_s" in run}  # fmt: skip
    for level, run in s["served"].get("levels", {}).items():
        if "output_throughput" in run:
            bars[f"served c={level}"] = run["output_throughput"]
    left.barh(list(bars), list(bars.values()), color="#4c72b0")
    left.set_xlabel("output tokens/s (smollm2-135m shape, bf16)")
    rows = s["bandwidth"].get("rows", [])
    labels = [f"{r['shape']}\nb={r['batch']} ctx={r['context']}" for r in rows]
    right.bar(labels, [r["attention_gbs"] for r in rows], color="#55a868")
    if "copy_gbs" in s["bandwidth"]:
        right.axhline(s["bandwidth"]["copy_gbs"], color="k", ls="--", label="copy bandwidth")
        right.legend()
    right.set_ylabel("decode attention GB/s")
    right.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"portico bench gpu: {report['card'].get('name', '?')}")
    fig.tight_layout()
    return _save(plt, fig, path)


def _card() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "total_memory_bytes": props.total_memory,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": __import__("triton").__version__}  # fmt: skip


def _run_section(
    sections: dict[str, Any],
    name: str,
    need_s: float,
    budget: Budget,
    fn: Callable[[], dict[str, Any]],
    wanted: Sequence[str] = SECTIONS,
) -> None:
    """Run one section if it is ``wanted`` and ``need_s`` seconds are left; its failure is
    reported, not raised."""
    if name not in wanted:
        return
    if budget.left() < need_s:
        sections[name] = {"skipped": f"time budget ({budget.left():.0f} s left)"}
        return
    start = time.monotonic()
    try:
        sections[name] = fn()
    except Exception as exc:  # the other sections still run
        sections[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    sections[name]["seconds"] = round(time.monotonic() - start, 1)
    print(f"{name}: {sections[name]['seconds']} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="portico bench gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("load/results/gpu.json"))
    parser.add_argument("--plot", type=Path, default=Path("load/results/gpu.png"))
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--no-compile", action="store_true",
                        help="skip transformers' static cache under torch.compile")  # fmt: skip
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="only these sections (the others: reported as not run)")  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("portico bench gpu: needs a CUDA device (torch sees none); on a CPU use "
              "`portico bench engine` and `make test`", file=sys.stderr)  # fmt: skip
        return 2
    budget, start = Budget(args.budget_s), time.monotonic()
    sections: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="portico-gpu-bench-") as tmp:
        workdir = Path(tmp)
        folder = write_shape_folder(workdir / "smollm2-135m-shape", SHAPES["smollm2-135m"])
        wanted = args.sections

        def run(name: str, need_s: float, fn: Callable[[], dict[str, Any]]) -> None:
            _run_section(sections, name, need_s, budget, fn, wanted)

        run("kernels", 20, lambda: kernels_section(budget))
        run("greedy", 60, lambda: greedy_section(workdir))
        run("offline", 60, lambda: offline_section(budget, folder, not args.no_compile))
        run("served", 60, lambda: served_section(budget, folder, workdir))
        served = sections.get("served", {})
        run("bandwidth", 10, lambda: bandwidth_section(budget, served))
        run("fp8", 60, lambda: fp8_section(workdir))
        run("async", 40, lambda: async_section(workdir))
        run("invariant", 40, lambda: invariant_section(workdir))
    command = "portico bench gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    report = build_report(_card(), sections, time.monotonic() - start, command.strip())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.plot)
    print("\n".join(summary_lines(report)))
    return 0 if all(report["verdicts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
