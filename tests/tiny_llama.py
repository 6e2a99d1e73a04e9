"""A tiny random Llama for tests, as a real Hugging Face folder.

Importable by any test (``from tiny_llama import build_tiny_llama``): tests/ is on sys.path
because tests/conftest.py lives there. Never import from ``conftest`` itself: several
conftest modules exist and only one of them owns that name in a full run.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

TINY_LLAMA_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def default_model_gguf() -> Path | None:
    from portico import registry

    try:
        return registry.resolve(registry.DEFAULT_MODEL).path
    except registry.ModelNotFound:
        return None


@functools.cache
def _load_real_tokenizer():  # type: ignore[no-untyped-def]
    """SmolLM2's tokenizer converted from the GGUF file, once per process (the conversion
    takes seconds of CPU; builds only read the tokenizer and save it into their folder)."""
    from transformers import AutoTokenizer

    gguf = default_model_gguf()
    if gguf is None:
        pytest.fail("the default model is missing: run `portico models pull smollm2-135m`")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def build_tiny_llama(folder: Path, seed: int = 0, **overrides: object) -> Path:
    """Write a random Llama (HF folder: config, safetensors, SmolLM2's tokenizer) to ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _load_real_tokenizer()
    params = dict(TINY_LLAMA_CONFIG, **overrides)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **params,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Random init with std 0.02 gives near-uniform logits; widen it so greedy decoding has
    # clear winners and ties between float paths are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed" in name else 0.08)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def build_tiny_reranker(
    folder: Path, seed: int = 0, architecture: str = "Llama", **overrides: object
) -> Path:
    """Write a random cross-encoder (``<architecture>ForSequenceClassification``, Llama or
    Qwen2, ``num_labels`` = 1, as such rerankers are saved) with SmolLM2's tokenizer to
    ``folder``. Its weights (biases too) are widened like the tiny Llama's so pairs get clearly
    different scores."""
    import torch
    import transformers

    config_cls = getattr(transformers, f"{architecture}Config")
    model_cls = getattr(transformers, f"{architecture}ForSequenceClassification")
    tokenizer = _load_real_tokenizer()
    params = dict(TINY_LLAMA_CONFIG, **overrides)
    config = config_cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
        **params,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):  # the norms keep their ones
                p.normal_(0.0, 0.3 if "embed" in name else 0.08)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
