"""Our Llama over the paged KV cache against transformers' implementation.

The proof: for a step sequence that mixes full prefills, prefill chunks and decodes of ragged
requests whose block tables are shuffled (not contiguous), every logit we compute equals
transformers' logits for the same position of the same sequence (fp32, atol 1e-4).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.model_config import ModelConfig
from engine.model_loader import LoadedModel, load_model
from engine.models.rotary import rope_inv_freq
from portico.registry import resolve

BLOCK_SIZE = 4
# Request lengths (prompt + decoded tokens) and the steps: (request, new tokens), decodes first.
LENGTHS = [13, 25, 7]
STEPS = [
    [(0, 11), (1, 8)],  # a full prefill and the first chunk of another
    [(0, 1), (1, 9), (2, 5)],  # a decode, a middle chunk, a full prefill
    [(0, 1), (2, 1), (1, 6)],  # decodes, then the last chunk
    [(1, 1), (2, 1)],  # decodes only: the batched path
    [(1, 1)],
]


def run_steps(
    loaded: LoadedModel, sequences: list[list[int]], steps: list[list[tuple[int, int]]]
) -> dict[int, dict[int, torch.Tensor]]:
    """Run ``steps`` through the paged cache; logits by request and absolute position."""
    cfg = loaded.config
    rng = random.Random(7)
    needed = [-(-len(s) // BLOCK_SIZE) for s in sequences]
    pool = list(range(1, sum(needed) + 5))
    rng.shuffle(pool)
    tables, at = [], 0
    for n in needed:
        tables.append(pool[at : at + n])
        at += n
    shape = (2, max(pool) + 1, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    caches = [torch.zeros(shape, dtype=loaded.dtype) for _ in range(cfg.num_hidden_layers)]
    computed = [0] * len(sequences)
    logits: dict[int, dict[int, torch.Tensor]] = {i: {} for i in range(len(sequences))}
    for step in steps:
        ids, positions, q_lens, s_lens, step_tables = [], [], [], [], []
        for req, n in step:
            start = computed[req]
            ids += sequences[req][start : start + n]
            positions += list(range(start, start + n))
            q_lens.append(n)
            s_lens.append(start + n)
            step_tables.append(tables[req])
            computed[req] += n
        meta = AttentionMetadata.build(q_lens, s_lens, step_tables, BLOCK_SIZE)
        with torch.inference_mode():
            hidden = loaded.model(torch.tensor(ids), torch.tensor(positions), caches, meta)
            out = loaded.model.compute_logits(hidden)
        row = 0
        for (req, n), s_len in zip(step, s_lens, strict=True):
            for i in range(n):
                logits[req][s_len - n + i] = out[row + i]
            row += n
    return logits


def _sequences(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _assert_matches_transformers(folder: Path, atol: float = 1e-4) -> None:
    from transformers import AutoModelForCausalLM

    loaded = load_model(resolve(str(folder)), torch.float32, "cpu")
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    sequences = _sequences(loaded.config.vocab_size)
    ours = run_steps(loaded, sequences, STEPS)
    for req, seq in enumerate(sequences):
        with torch.inference_mode():
            expected = reference(torch.tensor([seq])).logits[0]
        assert len(ours[req]) == len(seq)  # every position was computed exactly once
        for pos, row in ours[req].items():
            torch.testing.assert_close(row, expected[pos], atol=atol, rtol=1e-4)


def test_logits_match_transformers_for_mixed_prefill_chunks_and_decodes(
    tiny_llama_dir: Path,
) -> None:
    _assert_matches_transformers(tiny_llama_dir)


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    from tiny_llama import build_tiny_llama

    rope = {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    }  # fmt: skip
    folder = build_tiny_llama(tmp_path / "llama3", seed=3, rope_parameters=rope)
    assert load_model(resolve(str(folder))).config.rope_type == "llama3"
    _assert_matches_transformers(folder)


@pytest.mark.parametrize("architecture", ["Qwen2", "Mistral"])
def test_qwen2_and_mistral_match_transformers(
    architecture: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Qwen2 adds q/k/v biases; both are saved with an untied head and a sliding window."""
    import transformers
    from tiny_llama import TINY_LLAMA_CONFIG

    folder = tmp_path / architecture
    params = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "tie_word_embeddings"}
    config_cls = getattr(transformers, f"{architecture}Config")
    model_cls = getattr(transformers, f"{architecture}ForCausalLM")
    config = config_cls(vocab_size=49152, tie_word_embeddings=False, sliding_window=512, **params)
    torch.manual_seed(5)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "embed" in name else 0.08)  # biases too: make them matter
    model.save_pretrained(folder)
    for f in tiny_llama_dir.iterdir():
        if "token" in f.name or f.name.endswith((".txt", ".jinja")):
            shutil.copy(f, folder / f.name)
    loaded = load_model(resolve(str(folder)))
    assert loaded.config.qkv_bias == (architecture == "Qwen2")
    assert loaded.model.lm_head is not None
    if architecture == "Mistral":  # full attention is exact only inside the window
        assert loaded.config.max_position_embeddings == 512
    _assert_matches_transformers(folder)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_frequencies_match_transformers(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope, rope_theta=50000.0)
    hf_config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=1024,
        rope_parameters=rope,
    )  # fmt: skip
    ours = ModelConfig.from_hf(hf_config.to_dict())
    inv_freq, factor = rope_inv_freq(ours)
    if rope["rope_type"] == "default":
        expected = 1.0 / (50000.0 ** (torch.arange(0, 32, 2).float() / 32))
        expected_factor = 1.0
    else:
        expected, expected_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    torch.testing.assert_close(inv_freq, expected.float())
    assert factor == pytest.approx(expected_factor)


def test_unsupported_rope_scaling_is_a_clear_error() -> None:
    raw = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
           "intermediate_size": 8, "vocab_size": 10,
           "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}  # fmt: skip
    with pytest.raises(ValueError, match="RoPE scaling 'longrope' is not supported"):
        ModelConfig.from_hf(raw)


def test_bf16_model_runs_and_agrees_with_fp32(tiny_llama_dir: Path) -> None:
    fp32 = load_model(resolve(str(tiny_llama_dir)), torch.float32, "cpu")
    bf16 = load_model(resolve(str(tiny_llama_dir)), torch.bfloat16, "cpu")
    assert bf16.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    sequences = _sequences(fp32.config.vocab_size, seed=1)
    want = run_steps(fp32, sequences, STEPS)
    got = run_steps(bf16, sequences, STEPS)
    agree = total = 0
    for req in want:
        for pos, row in got[req].items():
            assert row.dtype == torch.float32 and torch.isfinite(row).all()
            assert (row - want[req][pos]).abs().max() < 0.25 * want[req][pos].abs().max()
            agree += int(row.argmax() == want[req][pos].argmax())
            total += 1
    assert agree >= 0.9 * total
