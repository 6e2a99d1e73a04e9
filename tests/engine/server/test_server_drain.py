"""SIGTERM drains a real engine process served on a Unix socket: in-flight streams complete,
new requests get 503, /ready turns 503, and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from engine_server_process import MODEL_NAME, EngineProcess

NUM_STREAMS = 8
MAX_TOKENS = 900  # long enough that the streams are still running when the ninth request comes
WAIT_S = 240.0  # generous bound for a busy 2-core machine; no assertion on time


class Stream(threading.Thread):
    """One streaming completion read to the end; records what it saw."""

    def __init__(self, server: EngineProcess) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.started = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": "Drain",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with (
                self.server.client() as client,
                client.stream("POST", "/v1/completions", json=body) as resp,
            ):
                for line in resp.iter_lines():
                    if line:
                        self.events.append(line)
                        self.started.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.started.set()


@pytest.fixture
def draining_server(tiny_llama_dir: Path, tmp_path: Path) -> EngineProcess:
    server = EngineProcess(
        tiny_llama_dir,
        tmp_path / "engine.log",
        uds=str(tmp_path / "e.sock"),
        extra=["--max-model-len", "1024", "--drain-timeout", str(WAIT_S)],
    )
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.mark.slow
def test_sigterm_finishes_in_flight_streams_refuses_new_work_and_exits_0(
    draining_server: EngineProcess,
) -> None:
    server = draining_server
    assert Path(server.uds or "").stat().st_mode & 0o777 == 0o600  # the socket is owner-only
    with server.client() as client:
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 1024
    streams = [Stream(server) for _ in range(NUM_STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(WAIT_S)
        assert s.error is None, s.error

    server.proc.send_signal(signal.SIGTERM)
    with server.client() as client:
        deadline = time.monotonic() + WAIT_S
        while client.get("/ready").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ninth = client.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "late", "max_tokens": 2}
        )
        assert ninth.status_code == 503
        assert ninth.json()["error"]["code"] == "draining"
        assert client.get("/health").status_code == 200  # draining is not dying

    for s in streams:
        s.join(WAIT_S)
        assert not s.is_alive()
        assert s.error is None, s.error
        assert s.events[-1] == "data: [DONE]"
        usage = json.loads(s.events[-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        finishes = [json.loads(e[len("data: ") :])["choices"] for e in s.events[:-2]]
        assert finishes[-1][0]["finish_reason"] == "length"

    assert server.proc.wait(timeout=WAIT_S) == 0, server.logs()
    assert not Path(server.uds or "").exists()  # the socket is removed on exit
    server.stop()
    with pytest.raises(httpx.TransportError), server.client() as client:
        client.get("/health")


@pytest.mark.slow
def test_drain_timeout_cuts_streams_with_an_error_event_and_exits_0(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    server = EngineProcess(
        tiny_llama_dir,
        tmp_path / "engine.log",
        extra=["--max-model-len", "1024", "--drain-timeout", "0"],
    )
    try:
        server.wait_ready()
        stream = Stream(server)
        stream.start()
        assert stream.started.wait(WAIT_S) and stream.error is None
        server.proc.send_signal(signal.SIGTERM)
        stream.join(WAIT_S)
        assert stream.error is None, stream.error
        assert stream.events[-1] == "data: [DONE]"
        error = json.loads(stream.events[-2][len("data: ") :])["error"]
        assert error["type"] == "service_unavailable" and error["message"]
        assert server.proc.wait(timeout=WAIT_S) == 0, server.logs()
    finally:
        server.stop()
