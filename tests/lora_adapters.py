"""PEFT adapters made at test time, and their merged-weights greedy references.

Importable by any test (tests/ is on sys.path). ``make_adapter`` writes a real PEFT folder
(``adapter_config.json`` + ``adapter_model.safetensors``) with random A *and* B (PEFT
initialises B to zero, which would make every adapter the base model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_adapter(
    base: Any,
    folder: Path,
    *,
    rank: int,
    targets: list[str],
    seed: int,
    alpha: float = 16.0,
    use_rslora: bool = False,
    std: float = 0.05,
) -> Path:
    """Wrap ``base`` (a transformers model; left unchanged) in a random LoRA and save it."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=use_rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    peft_model.save_pretrained(str(folder))
    return folder


def merged_greedy(base: Any, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``base`` with ``adapter`` merged into its weights (float32, no cache)."""
    import copy

    model = copy.deepcopy(base)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]
