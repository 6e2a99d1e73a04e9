"""``--load-format`` (vLLM's flag): ``dummy`` random weights for a folder holding only a
config.json and a tokenizer, the formats that must match the files, and clear refusals."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_loader import DUMMY_STD, load_model
from engine.sampling_params import SamplingParams
from portico.registry import ModelNotFound, ModelSource, resolve


@pytest.fixture(scope="module")
def shape_only(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's config.json (one layer more, untied head) and tokenizer, no weights."""
    folder = tmp_path_factory.mktemp("shape-only")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors"))  # fmt: skip
    raw = json.loads((folder / "config.json").read_text())
    raw.update(num_hidden_layers=3, tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_dummy_weights_fill_every_parameter_of_the_configs_shape(shape_only: Path) -> None:
    loaded = load_model(resolve(str(shape_only)), torch.float32, "cpu", load_format="dummy")
    cfg = loaded.config
    assert cfg.num_hidden_layers == 3 and loaded.model.lm_head is not None
    qkv = loaded.model.model.layers[2].self_attn.qkv_proj.weight
    assert qkv.shape == ((4 + 2 * 2) * 16, 64) and qkv.device.type == "cpu"
    assert abs(float(qkv.detach().std()) - DUMMY_STD) < 0.1 * DUMMY_STD
    assert torch.equal(loaded.model.model.norm.weight, torch.ones(64))
    assert not any(p.is_meta for p in loaded.model.parameters())
    again = load_model(resolve(str(shape_only)), torch.float32, "cpu", load_format="dummy")
    assert torch.equal(again.model.lm_head.weight, loaded.model.lm_head.weight)  # seeded


def test_an_engine_serves_dummy_weights(shape_only: Path) -> None:
    config = EngineConfig(model=str(shape_only), device="cpu", dtype="float32",
                          load_format="dummy", num_gpu_blocks_override=32)  # fmt: skip
    llm = LLM.from_engine(LLMEngine.from_config(config))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([[11, 12, 13, 14], [20, 21]], params)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    vocab = llm.engine.vocab_size
    assert all(0 <= t < vocab for o in out for t in o.outputs[0].token_ids)


def test_dummy_is_refused_for_a_gguf_and_a_folder_without_tokenizer(
    smollm2_gguf: Path, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    with pytest.raises(ValueError, match="is a GGUF file, which holds its own weights"):
        load_model(resolve(str(smollm2_gguf)), load_format="dummy")
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ModelNotFound, match="needs a tokenizer"):
        load_model(resolve(str(tmp_path)), load_format="dummy")
    with pytest.raises(ModelNotFound, match="no config.json"):
        load_model(ModelSource("bare", tmp_path / "nothing", "hf"), load_format="dummy")


def test_a_format_that_does_not_match_the_files_is_refused(
    smollm2_gguf: Path, tiny_llama_dir: Path
) -> None:
    with pytest.raises(ValueError, match="--load-format safetensors does not match"):
        load_model(resolve(str(smollm2_gguf)), load_format="safetensors")
    with pytest.raises(ValueError, match="--load-format gguf does not match"):
        load_model(resolve(str(tiny_llama_dir)), load_format="gguf")
    loaded = load_model(resolve(str(tiny_llama_dir)), load_format="safetensors")
    assert loaded.config.num_hidden_layers == 2


def test_the_flag_takes_vllms_values_and_names_itself_when_wrong() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--load-format", "dummy"])
    assert EngineConfig.from_cli_args(args).load_format == "dummy"
    assert EngineConfig().load_format == "auto"
    with pytest.raises(ValueError, match="--load-format"):
        EngineConfig(load_format="npcache")
