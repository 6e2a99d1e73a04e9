"""A Qwen2-VL scenario through one kernel choice: greedy tokens out.

Run as a script (``python qwen2_vl_triton_check.py MODEL_DIR``) in a process whose environment
sets ``TRITON_INTERPRET=1`` and ``PORTICO_KERNEL_DEVICE=cuda`` before triton is imported: the
engine then takes the CUDA kernel choice (Triton attention and KV writes, the PyTorch RoPE
reference with M-RoPE's per-token rows) on CPU tensors, interpreted. Prints one JSON line.
``test_qwen2_vl.py`` runs the same scenario in-process on the CPU path and compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from engine import kernels
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model
from engine.multimodal import attach_images
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource


def _picture(seed: int, size: tuple[int, int]) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def run_scenario(model_dir: Path, device: str = "cpu") -> dict[str, Any]:
    """Two odd-sized images and text, prefilled in chunks of 16 that cut through the images,
    then 12 greedy decode steps at M-RoPE's shifted positions, on ``device``."""
    loaded = load_model(ModelSource("tiny-qwen2-vl", model_dir, "hf"), torch.float32, device)
    images = [_picture(0, (101, 67)), _picture(1, (84, 56))]
    parts: list[dict[str, Any]] = [{"type": "image"}, {"type": "text", "text": "and"}]
    parts += [{"type": "image"}, {"type": "text", "text": "What differs between them?"}]
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    ids, mm = attach_images(
        tok.encode(text, add_special_tokens=False), images, loaded.image_processor, loaded.model
    )
    config = EngineConfig(
        model="tiny-qwen2-vl", device=device, dtype="float32", max_num_batched_tokens=16
    )
    engine = LLMEngine(config, loaded)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("r0", ids, params, mm_inputs=tuple(mm))
    while True:
        done = [out for out in engine.step() if out.finished]
        if done:
            choice = kernels.choose(device)
            return {"tokens": done[0].outputs[0].token_ids, "attention": choice.paged_attention}


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(run_scenario(Path(sys.argv[1]))))
