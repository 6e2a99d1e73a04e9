"""``load/carried_prompt_bench.py`` runs on a tokenizer and reports each cost it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load import carried_prompt_bench


def test_the_bench_reports_every_cost_for_the_prompt(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    carried_prompt_bench.main(["--model", str(tiny_llama_dir), "--words", "40", "--calls", "2"])
    report = json.loads(capsys.readouterr().out)
    assert report["prompt_tokens"] > 40
    for key in ("engine_render_and_encode_us", "engine_carried_ids_us", "gateway_write_ids_us",
                "engine_parse_ids_us"):  # fmt: skip
        assert report[key] > 0
