"""The paired one-stream bench against two fake upstreams of known pace: the slower one's time
per output token comes out slower, pair by pair."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from load import paired_stream_bench as bench


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fake(delay_ms: int) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "load.fake_upstream", "--port", str(port),
         "--chunk-delay-ms", str(delay_ms)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and "listening" in proc.stdout.readline()
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[str, str]]:
    fast, url_fast = _fake(1)
    slow, url_slow = _fake(8)
    yield url_fast, url_slow
    for proc in (fast, slow):
        proc.terminate()
        proc.wait(timeout=10)


def test_the_slower_server_has_the_larger_time_per_token(fakes: tuple[str, str]) -> None:
    fast, slow = fakes
    a, b = bench.run(fast, slow, "fake-model", bench.prompts(4, 5, 9, seed=1), output_len=6)
    assert len(a.tpot) == len(b.tpot) == 4
    assert bench.paired_ratio(a.tpot, b.tpot) > 2  # 8 ms against 1 ms between chunks
    # The whole request holds the first chunk and every gap after it.
    for t in (a, b):
        assert all(w > f + 4 * g for w, f, g in zip(t.request, t.ttft, t.tpot, strict=True))
    assert bench.paired_ratio(a.request, b.request) > 1.5
    assert "B / A paired median" in bench.report(a, b) and "request:" in bench.report(a, b)


def test_prompts_are_reproducible_and_in_range() -> None:
    first, again = bench.prompts(5, 3, 7, seed=2), bench.prompts(5, 3, 7, seed=2)
    assert first == again and all(3 <= len(p) <= 7 for p in first)
    assert bench.paired_ratio([1.0, 2.0, 4.0], [2.0, 2.0, 2.0]) == 1.0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench.main(["http://a", "http://b", "--prompt-len", "9,3"])
