"""``portico models pull`` writes the GGUF model's tokenizer beside it as Hugging Face files, so
any Hugging Face tool (a benchmark such as guidellm, transformers itself) loads it from the
folder without the ``gguf`` package; the gateway counts prompt tokens with it too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from portico import registry

# Load the folder's tokenizer with the gguf package made unimportable, and print what it makes
# of a chat and a text.
NO_GGUF_LOAD = """
import json, sys
sys.modules["gguf"] = None
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
chat = [{"role": "user", "content": "What is 2+2?"}]
print(json.dumps({
    "chat": tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
    "ids": tok("Hello, Portico!")["input_ids"],
    "max_length": tok.model_max_length,
}))
"""


@pytest.mark.slow  # converts the GGUF vocabulary once (~20-40 s of CPU here)
def test_pull_writes_a_tokenizer_folder_that_loads_without_gguf(
    tmp_path: Path, smollm2_gguf: Path
) -> None:
    env = {**os.environ, "PORTICO_MODELS_DIR": str(tmp_path)}
    pull = [sys.executable, "-m", "portico.cli", "models", "pull", "smollm2-135m"]
    out = subprocess.run(pull, capture_output=True, text=True, env=env, check=True).stdout
    folder = tmp_path / "smollm2-135m"
    assert f"tokenizer (Hugging Face files, for AutoTokenizer.from_pretrained): {folder}" in out
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (folder / name).is_file(), name
    assert (
        "<|im_start|>"
        in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    )
    loaded = subprocess.run(
        [sys.executable, "-c", NO_GGUF_LOAD, str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    seen = json.loads(loaded.stdout)
    # the same tokenizer as transformers builds from the GGUF file itself
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert seen["chat"] == reference.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert seen["ids"] == reference("Hello, Portico!")["input_ids"]
    assert seen["max_length"] == 8192  # the model's context, not transformers' "unbounded"
    # a second pull keeps the files; the folder still resolves to the GGUF model
    assert not registry.write_tokenizer_folder(smollm2_gguf, folder)
    source = registry.resolve(folder)
    assert (source.format, source.path.name) == ("gguf", smollm2_gguf.name)


def test_a_gguf_beside_its_tokenizer_files_is_still_the_gguf_model(
    tmp_path: Path,
    tiny_llama_dir: Path,
    smollm2_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PORTICO_MODELS_DIR", str(tmp_path))
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / smollm2_gguf.name).symlink_to(smollm2_gguf)
    assert registry.tokenizer_folder(registry.resolve(folder)) is None  # none written yet
    for name in registry.TOKENIZER_FILES:
        shutil.copy(tiny_llama_dir / name, folder / name)
    source = registry.resolve(folder)
    assert source.format == "gguf"  # config.json without weights: not a Hugging Face model
    assert registry.tokenizer_folder(source) == folder
    # a Hugging Face folder (config.json and weights) stays one, a .gguf file beside or not
    assert registry.resolve(tiny_llama_dir).format == "hf"
