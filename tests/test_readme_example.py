"""The README's first example, run as written against a real engine serving the default model.

A newcomer's first reply decides whether they keep going: the example's sampling settings must
give the default 135M model's sensible answer, not the word salad it writes at temperature 1.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from engine.model_loader import resolve_quantization
from engine.numerics import auto_cpu_numerics, cpu_flags
from portico.registry import resolve
from tests.engine.server.engine_server_process import API_KEY, MODEL_NAME, EngineProcess

REPO_ROOT = Path(__file__).resolve().parent.parent


def readme_example() -> tuple[dict[str, Any], str]:
    """The keyword arguments of the README's first ``create(...)`` call and the reply it shows
    in the comment of its ``print`` line."""
    text = (REPO_ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None, "the README has no python example"
    call = next(
        node
        for node in ast.walk(ast.parse(code.group(1)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "create"
    )
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
    shown = re.search(r"print\(reply\.choices\[0\]\.message\.content\)\s*#\s*(.+)", code.group(1))
    assert shown is not None, "the example shows no reply"
    return kwargs, shown.group(1).strip()


@pytest.fixture(scope="module")
def default_model_engine(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    # --dtype auto: the numerics `make run` serves on this machine (engine/numerics.py)
    server = EngineProcess(
        smollm2_gguf, tmp_path_factory.mktemp("readme") / "engine.log", dtype="auto"
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_the_readme_example_prints_the_reply_it_shows(
    default_model_engine: EngineProcess, smollm2_gguf: Path
) -> None:
    kwargs, shown = readme_example()
    assert kwargs["model"] == "smollm2"  # the model `make run` serves under that name
    client = OpenAI(base_url=default_model_engine.base_url + "/v1", api_key=API_KEY)
    # three times: from the second on its prompt's blocks are cached (issue 42)
    for _ in range(3):
        reply = client.chat.completions.create(**dict(kwargs, model=MODEL_NAME))
        assert reply.choices[0].message.content == shown
    # ... computed on the path --dtype auto picks for this CPU, as /v1/models says
    card = client.models.list().data[0].model_extra["numerics"]
    source = resolve(str(smollm2_gguf))
    gguf_blocks = resolve_quantization("auto", source, "cpu") == "gguf"
    assert card == auto_cpu_numerics(cpu_flags(), gguf_blocks, "int8").as_dict()
