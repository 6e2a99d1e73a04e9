"""`portico engine` flags: parsing, the API key's sources, and refusals before any model load."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from engine.server import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_listen_on_loopback_with_vllm_flag_names() -> None:
    args = parse("--model", "m", "--served-model-name", "s", "--max-num-seqs", "4")
    assert (args.host, args.port, args.uds) == ("127.0.0.1", 8000, None)
    assert args.max_num_seqs == 4 and args.served_model_name == "s"
    settings = cli.server_settings(args, "s")
    assert settings.max_body_bytes == 4 * 1024 * 1024 and settings.drain_timeout_s == 30


def test_api_key_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli.server_settings(parse(), "m").api_key == "from-env"
    assert cli.server_settings(parse("--api-key", "from-flag"), "m").api_key == "from-flag"
    monkeypatch.delenv(cli.API_KEY_ENV)
    assert cli.server_settings(parse(), "m").api_key is None


def test_tool_flags_reach_the_settings() -> None:
    args = parse("--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    settings = cli.server_settings(args, "m")
    assert (settings.tool_call_parser, settings.enable_auto_tool_choice) == ("hermes", True)
    assert cli.server_settings(parse(), "m").tool_call_parser is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
        (["--max-body-bytes", "0"], "--max-body-bytes"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--enable-auto-tool-choice"], "--tool-call-parser"),
        (["--tool-call-parser", "nope"], "--tool-call-parser"),
        (["--model", "/no/such/model"], "portico models pull"),
    ],
)
def test_bad_flags_exit_2_with_a_message_naming_them(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "portico.cli", "engine", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
