"""transformers' scores of text pairs, the oracle of /v1/score and /v1/rerank: a cross-encoder's
relevance (the sigmoid of its one logit over the pair tokenized as one sequence) and an
embedding model's cosine (of the last token's final hidden states, the engine's default
pooling). Importable by any test (tests/ is on sys.path, as for tiny_llama)."""

from __future__ import annotations

from pathlib import Path

import torch


def cross_encoder_scores(folder: Path, pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    """transformers' relevance of each pair (sigmoid of the one logit) and the tokens read."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = LlamaForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32)
    scores, num_tokens = [], 0
    with torch.no_grad():
        for a, b in pairs:
            ids = tokenizer(a, b, return_tensors="pt")["input_ids"]
            scores.append(torch.sigmoid(model(ids).logits[0, 0]).item())
            num_tokens += ids.shape[1]
    return scores, num_tokens


def cosine_scores(folder: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """transformers' cosine of the two texts' last hidden states (the engine's LAST pooling)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)

    def embed(text: str) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([tokenizer.encode(text)])
            return model.model(ids).last_hidden_state[0, -1]

    return [torch.cosine_similarity(embed(a), embed(b), dim=0).item() for a, b in pairs]
