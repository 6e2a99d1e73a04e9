"""An OpenAI-compatible engine stand-in whose streams wait on a gate the test opens.

The gateway supervises it like a real engine (``engines[].command`` in the gateway config):
it listens on the Unix socket the supervisor names and answers ``/health``, ``/ready``,
``/v1/models`` and ``/v1/chat/completions``. A streamed completion sends its first chunk
(``"first"``), then waits until a file named by the request's ``gate`` field appears in
``--gate-dir`` before sending ``"released"`` and finishing. If the gate is never opened it
gives up after ``--gate-timeout`` seconds and sends ``"gate-timeout"`` instead, so a proxy that
buffers the stream shows up as a wrong final word, never as a hung test.

Every completion echoes the ``x-request-id`` it received, so the tests can follow one id from
the client through nginx and the gateway to the engine. ``/metrics`` is the real engine
server's exposition (``engine.server.metrics.ServerMetrics``), with vLLM's names.

    python gated_engine.py (--uds PATH | --port N) --gate-dir DIR [--served-model-name NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.stats import EngineStats


def _chunk(model: str, created: int, delta: dict[str, str], finish: str | None) -> bytes:
    event = {
        "id": "chatcmpl-gated",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def build_app(model: str, gate_dir: Path, gate_timeout_s: float) -> Starlette:
    async def ok(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    metrics = ServerMetrics(model, 2048, EngineStats)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def wait_for_gate(name: str) -> str:
        gate = gate_dir / name
        deadline = time.monotonic() + gate_timeout_s
        while time.monotonic() < deadline:
            if gate.exists():
                return "released"
            await asyncio.sleep(0.02)
        return "gate-timeout"

    async def chat(request: Request) -> Response:
        body = await request.json()
        request_id = request.headers.get("x-request-id", "")
        created = int(time.time())
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": "chatcmpl-gated",
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": f"request-id={request_id}"},
                        }
                    ],
                    "usage": usage,
                }
            )
        gate_name = str(body.get("gate", "")).replace("/", "_") or "missing"

        async def events() -> AsyncIterator[bytes]:
            yield _chunk(model, created, {"role": "assistant", "content": "first"}, None)
            word = await wait_for_gate(gate_name)
            yield _chunk(model, created, {"content": f" {word} request-id={request_id}"}, None)
            yield _chunk(model, created, {}, "stop")
            if (body.get("stream_options") or {}).get("include_usage"):
                event = {
                    "id": "chatcmpl-gated",
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/health", ok),
            Route("/ready", ok),
            Route("/v1/models", models),
            Route("/metrics", metrics_endpoint),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--uds", help="Unix socket to listen on (as the gateway supervises it)")
    where.add_argument("--port", type=int, help="loopback TCP port (for nginx alone)")
    parser.add_argument("--gate-dir", required=True, type=Path)
    parser.add_argument("--served-model-name", default="gated")
    parser.add_argument("--gate-timeout", type=float, default=60.0)
    args = parser.parse_args()
    app = build_app(args.served_model_name, args.gate_dir, args.gate_timeout)
    if args.uds:
        uvicorn.run(app, uds=args.uds, log_level="warning", lifespan="off")
    else:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
