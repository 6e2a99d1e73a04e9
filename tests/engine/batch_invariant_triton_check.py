"""``--batch-invariant`` on the CUDA kernel choice, on CPU tensors under ``TRITON_INTERPRET=1``.

Run as a script (``python batch_invariant_triton_check.py MODEL_DIR``) in a process whose
environment sets ``TRITON_INTERPRET=1`` and ``PORTICO_KERNEL_DEVICE=cuda`` before triton is
imported. Prints one JSON line of findings; ``test_batch_invariant_triton.py`` asserts them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine import kernels
from engine.config import EngineConfig
from engine.kernels import triton_invariant
from engine.kernels.reference import add_rms_norm_ref
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

# Row slices at the same places of their 64-row tiles as in the full call (the call's size
# changes, a row's place in its tile does not), and slices that move rows within a tile.
ALIGNED = ((0, 1), (0, 5), (0, 64), (64, 65), (64, 70))
SHIFTED = ((30, 35), (69, 70))


def _rows_alone_equal(fn: Any, x: torch.Tensor, full: torch.Tensor, slices: Any) -> bool:
    """Whether fn of each slice of x's rows gives the full call's rows bit for bit."""
    return all(torch.equal(fn(x[a:b]), full[a:b]) for a, b in slices)


def kernel_findings(device: str = "cpu", dtypes: Any = (torch.float32,)) -> dict[str, Any]:
    """The kernels' rows against the full call's; on CPU float32 only: the interpreter does
    not compute in bfloat16 (NumPy has no such type)."""
    gen = torch.Generator().manual_seed(0)
    found: dict[str, Any] = {}
    for dtype in dtypes:
        x = torch.randn(70, 80, generator=gen).to(device, dtype)  # K 80: a partial last K tile
        w = (torch.randn(72, 80, generator=gen) * 0.1).to(device, dtype)  # N 72: partial N tile
        b = torch.randn(72, generator=gen).to(device, dtype)
        full = triton_invariant.linear(x, w, b)
        name = str(dtype).removeprefix("torch.")
        for kind, slices in (("aligned", ALIGNED), ("shifted", SHIFTED)):
            found[f"linear_{name}_rows_{kind}_equal"] = _rows_alone_equal(
                lambda part, w=w, b=b: triton_invariant.linear(part, w, b), x, full, slices
            )
        want = x.float() @ w.float().T + b.float()
        found[f"linear_{name}_max_error"] = float((full.float() - want).abs().max())

        weight = (1 + 0.1 * torch.randn(80, generator=gen)).to(device, dtype)
        delta = torch.randn(70, 80, generator=gen).to(device, dtype)
        xs = x.clone()
        normed = triton_invariant.add_rms_norm(xs, delta, weight, 1e-5)
        expect_x = x.clone()
        expect = add_rms_norm_ref(expect_x, delta, weight, 1e-5)
        found[f"norm_{name}_residual_equal"] = torch.equal(xs, expect_x)
        found[f"norm_{name}_max_error"] = float((normed.float() - expect.float()).abs().max())

        def norm(part: torch.Tensor, weight: torch.Tensor = weight) -> torch.Tensor:
            return triton_invariant.add_rms_norm(part.clone(), None, weight, 1e-5)

        found[f"norm_{name}_rows_invariant"] = _rows_alone_equal(
            norm, xs, norm(xs), ALIGNED + SHIFTED
        )
    return found


VOCAB = 512  # the tiny Llama's vocabulary cut to this: the interpreted LM head stays quick


def _tokens(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % (VOCAB - 20) + 10 for i in range(n)]


def small_vocab_copy(src: Path, dst: Path) -> Path:
    """The tiny Llama folder ``src`` with its (tied) embedding cut to :data:`VOCAB` rows."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights = {k: v[:VOCAB].contiguous() if "embed_tokens" in k else v for k, v in weights.items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] = VOCAB
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _greedy(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[Any]]:
    """Each request's greedy tokens and, per step, its two best log-probabilities (the logits'
    numbers, not only their argmax)."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, list[Any]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                steps = out.outputs[0].logprobs or []
                done[out.request_id] = [
                    list(out.outputs[0].token_ids),
                    [[lp for _, lp in step.top_logprobs] for step in steps],
                ]
    return done


def engine_findings(model_dir: Path, device: str = "cpu", dtype: str = "float32") -> dict[str, Any]:
    """One prompt's greedy tokens alone, cached, beside four others and in 7-token chunks."""

    def engine(**flags: Any) -> LLMEngine:
        return LLMEngine.from_config(
            EngineConfig(
                model=str(model_dir), device=device, dtype=dtype, batch_invariant=True, **flags
            )  # fmt: skip
        )

    prompt = _tokens(41, start=5)
    others = {f"o{i}": _tokens(9 + 13 * i, start=300 * (i + 1)) for i in range(4)}
    first = engine()
    alone = _greedy(first, {"p": prompt})["p"]
    cached = _greedy(first, {"p2": prompt})["p2"]
    batched = _greedy(engine(), {"p": prompt, **others})["p"]
    chunked = _greedy(engine(max_num_batched_tokens=7), {"p": prompt, **others})["p"]
    numerics = first.numerics
    mode = kernels.batch_invariant()
    control = {}  # the same two runs without --batch-invariant: cuBLAS's stand-in and split-K
    for name, others_now in (("alone", {}), ("batched", others)):
        plain = LLMEngine.from_config(
            EngineConfig(model=str(model_dir), device=device, dtype=dtype)
        )
        control[name] = _greedy(plain, {"p": prompt, **others_now})["p"]
    return {
        "control_alone": control["alone"],
        "control_batched": control["batched"],
        "alone": alone,
        "cached": cached,
        "batched": batched,
        "chunked": chunked,
        "path_batch_invariant": numerics.batch_invariant,
        "path_reason": numerics.reason,
        "mode": mode,
        "attention": kernels.choose(device).paged_attention,
    }


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 before running this check")
    with tempfile.TemporaryDirectory() as tmp:
        model = small_vocab_copy(Path(sys.argv[1]), Path(tmp) / "tiny")
        print(json.dumps({**kernel_findings(), **engine_findings(model)}))
