"""Loading models: a Hugging Face folder, the real SmolLM2 GGUF, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.model_loader import LoadedModel, _unpermute_qk, choose_device, choose_dtype, load_model
from portico.registry import ModelNotFound, ModelSource, resolve

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> LoadedModel:
    return load_model(resolve(str(smollm2_gguf)), torch.float32, "cpu")


def _prefill_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    cfg = loaded.config
    blocks = -(-len(ids) // 16)
    caches = [
        torch.zeros(2, blocks + 1, 16, cfg.num_key_value_heads, cfg.head_dim)
        for _ in range(cfg.num_hidden_layers)
    ]
    table = list(range(blocks, 0, -1))  # reversed: not contiguous in the cache
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [table], 16)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
        return loaded.model.compute_logits(hidden)


def test_gguf_hyperparameters_come_from_its_metadata(smollm2: LoadedModel) -> None:
    cfg = smollm2.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings and smollm2.model.lm_head is None  # no output.weight
    qkv = smollm2.model.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.shape == ((9 + 2 * 3) * 64, 576)  # q, k, v merged
    assert smollm2.model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 1536, 576)
    assert smollm2.tokenizer.decode(smollm2.tokenizer("Hello world")["input_ids"]) == "Hello world"


@pytest.mark.slow
def test_gguf_logits_match_transformers_loading_the_same_file(
    smollm2: LoadedModel, smollm2_hf: Any
) -> None:
    reference = smollm2_hf  # transformers loading the same file
    for prompt in PROMPTS:
        ids = smollm2.tokenizer(prompt)["input_ids"]
        ours = _prefill_logits(smollm2, ids)
        with torch.inference_mode():
            expected = reference(torch.tensor([ids])).logits[0]
        assert ours[-1].argmax() == expected[-1].argmax(), prompt
        torch.testing.assert_close(ours, expected, atol=2e-3, rtol=1e-3)


def test_gguf_model_completes_a_fact_greedily(smollm2: LoadedModel) -> None:
    ids = smollm2.tokenizer("The capital of France is")["input_ids"]
    assert smollm2.tokenizer.decode(_prefill_logits(smollm2, ids)[-1].argmax()) == " Paris"


def test_unpermute_undoes_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    weight = torch.randn(heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf.py permute: rotate-half pairs -> interleaved pairs.
    permuted = weight.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(weight.shape)
    assert torch.equal(_unpermute_qk(permuted, heads), weight)


def test_hf_folder_loads_with_merged_projections(tiny_llama_dir: Path) -> None:
    loaded = load_model(resolve(str(tiny_llama_dir)), torch.float32, "cpu")
    attn = loaded.model.model.layers[1].self_attn
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
    assert loaded.model.lm_head is None  # tied
    assert loaded.device.type == "cpu" and loaded.dtype == torch.float32
    assert loaded.tokenizer.eos_token_id == loaded.config.eos_token_ids[0]


def test_missing_model_path_names_the_model(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="no-such-model"):
        load_model(ModelSource("no-such-model", tmp_path / "nope.gguf", "gguf"))
    with pytest.raises(ModelNotFound, match="empty-folder"):
        load_model(ModelSource("empty-folder", tmp_path, "hf"))


def test_folder_without_weights_names_the_folder(tmp_path: Path, tiny_llama_dir: Path) -> None:
    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ModelNotFound, match="no-weights.*no .safetensors"):
        load_model(resolve(str(folder)))


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path, tiny_llama_dir: Path) -> None:
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        load_model(resolve(str(tmp_path)))


def test_device_and_dtype_choice() -> None:
    assert choose_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert choose_device("auto").type == expected
    assert choose_dtype("auto", torch.device("cpu")) == torch.float32
    assert choose_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert choose_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtype("int3", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            choose_device("cuda")


def test_gguf_tokenizer_is_converted_once_then_read_from_cache(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    from engine.model_loader import _gguf_tokenizer, _tokenizer_cache_dir

    monkeypatch.setenv("PORTICO_MODELS_DIR", str(tmp_path / "models"))
    cache = _tokenizer_cache_dir(smollm2_gguf)
    assert cache.is_relative_to(tmp_path) and not cache.exists()
    first = _gguf_tokenizer(smollm2_gguf)
    assert (cache / "tokenizer_config.json").is_file()
    second = _gguf_tokenizer(smollm2_gguf)  # from the cache folder
    direct = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    chat = [{"role": "user", "content": "Héllo <|im_end|> 日本 🎉"}]
    for tok in (first, second):
        for text in ("Hello world", "  spaces\n\ttabs", "<|im_start|>user\nhi<|im_end|>"):
            assert tok(text)["input_ids"] == direct(text)["input_ids"]
        assert tok.apply_chat_template(chat, tokenize=False) == direct.apply_chat_template(
            chat, tokenize=False
        )
        assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (
            direct.eos_token_id, direct.bos_token_id, len(direct)
        )  # fmt: skip
