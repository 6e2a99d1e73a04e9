"""The kit a session lent a CUDA machine carries there (load/gpu_kit.py) and the command that
runs there (load/gpu_session.sh), as far as a machine without CUDA can check them: the
weightless model folder is served at the default model's shape, the wheel list pins what runs
here and refuses two versions of a package, and the script runs each step under its limit and
brings back its summary and logs."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from load import gpu_kit
from portico.registry import DEFAULT_MODEL, resolve, tokenizer_folder

REPO = Path(__file__).resolve().parents[2]


def test_the_model_folder_is_the_default_models_tokenizer_and_shape_without_weights(
    tmp_path: Path,
) -> None:
    source = tokenizer_folder(resolve(DEFAULT_MODEL))
    assert source is not None
    folder = gpu_kit.write_model_folder(tmp_path / DEFAULT_MODEL)
    assert not list(folder.glob("*.gguf")) and not list(folder.glob("*.safetensors"))
    assert resolve(str(folder)).format == "hf"  # a Hugging Face folder, not the GGUF
    assert json.loads((folder / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.chat_template  # a chat through the gateway needs it
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == AutoTokenizer.from_pretrained(str(source)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # --load-format dummy serves it: random weights of the model's shape, the real tokenizer
    llm = LLM(str(folder), load_format="dummy", max_model_len=256)
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_pins_are_the_installed_versions() -> None:
    pinned = gpu_kit.pins(("fastapi", "pydantic-core"))
    assert pinned == [
        f"fastapi=={importlib.metadata.version('fastapi')}",
        f"pydantic-core=={importlib.metadata.version('pydantic-core')}",
    ]
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        gpu_kit.pins(("no-such-package-here",))


def test_two_versions_of_one_package_are_refused(tmp_path: Path) -> None:
    names = [
        "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.whl",
        "pydantic-2.14.4-py3-none-any.whl",
    ]
    wheels = [tmp_path / name for name in names]
    gpu_kit._one_version_each(wheels)  # one of each: fine
    wheels.append(tmp_path / "Pydantic-2.13.0-py3-none-any.whl")
    with pytest.raises(SystemExit, match="two versions of pydantic"):
        gpu_kit._one_version_each(wheels)


def _session(stage: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    wheels = tmp_path / "no-wheels"
    wheels.mkdir()
    env = {
        **os.environ,
        "OUT": str(out),
        "DEVICE": "cpu",
        "WHEELS": str(wheels),
        # the script calls python3, the device image's; here, this environment's
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "load" / "gpu_session.sh"), stage],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, out


def _log(out: Path, stage: str, name: str) -> str:
    with tarfile.open(out / f"logs-{stage}.tgz") as logs:
        member = logs.extractfile(f"./{name}.log")
        assert member is not None
        return member.read().decode()


def test_the_session_script_runs_each_step_and_brings_back_its_summary_and_logs(
    tmp_path: Path,
) -> None:
    proc, out = _session("0", tmp_path)
    assert proc.returncode == 2 and "stage must be 1 or 2" in proc.stderr  # after the env step
    summary = (out / "summary.txt").read_text().splitlines()
    assert len(summary) == 1 and summary[0].startswith("env") and " rc=0 " in summary[0]
    env_log = _log(out, "0", "env")
    assert "no CUDA device" in env_log and "imports: ok" in env_log
    assert sorted(p.name for p in out.iterdir()) == ["logs-0.tgz", "summary.txt"]


def test_a_step_that_needs_cuda_fails_alone_and_the_stage_goes_on(tmp_path: Path) -> None:
    proc, out = _session("1", tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in (out / "summary.txt").read_text().splitlines()}
    assert list(lines) == ["env", "bench-gpu-1", "gpu-tests"]
    assert " rc=2 " in lines["bench-gpu-1"]  # portico bench gpu refuses without CUDA
    assert "needs a CUDA device" in _log(out, "1", "bench-gpu-1")
    assert " rc=0 " in lines["gpu-tests"]  # every test marked gpu skips without CUDA
    assert " skipped" in _log(out, "1", "gpu-tests")
