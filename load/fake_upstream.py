"""A very fast fake OpenAI-compatible upstream, for benchmarks and tests.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length bodies, chunked responses) on a raw
asyncio protocol so that it serves tens of thousands of requests per second on one core and is
never the bottleneck of a gateway benchmark. It does no inference: every completion is
``num_chunks`` copies of the word ``"tok"``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` and
``stream_options.include_usage`` honoured; any path ending in ``/chat/completions`` or
``/completions`` answers too, so Azure's ``/openai/deployments/<d>/...?api-version=`` does, which
needs its ``api-version``), ``POST /v1/messages`` (Anthropic's Messages API, stream and not,
for translation tests), ``GET /v1/models``, ``GET /health``, ``GET /ready``.

Command line (stable; other tests rely on it)::

    python -m load.fake_upstream --port 9000 [--host 127.0.0.1] [--uds PATH]
        [--chunks 8] [--chunk-delay-ms 0] [--model fake-model] [--status 200]
        [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]] [--no-usage]
        [--require-key KEY ...] [--fail-first N]

``--tls-*``: serve HTTPS (with ``--tls-client-ca``, require a client certificate it signs).
``--no-usage``: never report usage (streams or not), like providers that do not.
``--require-key``: answer 401 unless ``Authorization: Bearer <key>`` (or ``api-key``,
``x-api-key``) is one of these; the 401 message echoes the key's last characters, as OpenAI's
does. ``--fail-first N``: the first N completions answer 503.

Per request, these body fields override the flags: ``max_tokens`` (number of chunks, capped by
``--max-chunks``), ``fake_chunk_delay_ms`` and ``fake_status`` (answer with that HTTP status and
an OpenAI error body, to exercise retries).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import ssl
import time
from dataclasses import dataclass
from typing import Any

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


@dataclass
class FakeSettings:
    """How the fake answers: the model it claims, how many chunks, how fast."""

    model: str = "fake-model"
    chunks: int = 8
    max_chunks: int = 4096
    chunk_delay_ms: float = 0.0
    status: int = 200
    usage: bool = True
    keys: tuple[str, ...] = ()
    fail_first: int = 0
    served: int = 0  # completions answered so far (all connections)


def _response(
    status: int, body: bytes, content_type: bytes = b"application/json", extra: bytes = b""
) -> bytes:
    reason = _REASONS.get(status, "Status").encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n"
        % (status, reason, content_type, len(body), extra)
    ) + body


def _error(status: int, message: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "fake_error", "param": None, "code": None}}
    ).encode()
    return _response(status, body)


def _whole_answer(chat: bool, n: int, head: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed answer of ``n`` tokens: ``head`` (id, object, created, model) and one
    choice."""
    text = " tok" * n
    choice = (
        {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
            "logprobs": None,
        }
        if chat
        else {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
    )
    return {**head, "choices": [choice]}


class FakeUpstreamProtocol(asyncio.Protocol):
    """One connection: parses pipelined HTTP/1.1 requests and answers them in order."""

    def __init__(self, settings: FakeSettings) -> None:
        self.settings = settings
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue[tuple[str, str, dict[bytes, bytes], bytes] | None] = (
            asyncio.Queue()
        )
        self.worker: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (uvloop's is not a subclass)
        self.worker = asyncio.get_running_loop().create_task(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self.queue.put_nowait(None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].split(b"\r\n")
            try:
                method, target, _ = head[0].decode("latin-1").split(" ", 2)
            except ValueError:
                self._close_with(_error(400, "bad request line"))
                return
            headers: dict[bytes, bytes] = {}
            for line in head[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get(b"content-length", b"0") or 0)
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4 : head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length :]
            self.queue.put_nowait((method, target, headers, body))

    def _close_with(self, payload: bytes) -> None:
        if self.transport is not None:
            self.transport.write(payload)
            self.transport.close()

    async def _serve(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None or self.transport is None or self.transport.is_closing():
                return
            method, target, headers, body = item
            path, _, query = target.partition("?")
            if method == "POST" and not self._authorized(headers):
                continue
            if method == "GET" and path in ("/health", "/ready"):
                self.transport.write(_response(200, b'{"status":"ok"}'))
            elif method == "GET" and path == "/v1/models":
                card = {
                    "id": self.settings.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "fake",
                    "max_model_len": 1_000_000,
                }
                self.transport.write(
                    _response(200, json.dumps({"object": "list", "data": [card]}).encode())
                )
            elif method == "POST" and path.endswith("/messages"):
                await self._anthropic(body)
            elif method == "POST" and path.endswith("/completions"):
                if "/openai/deployments/" in path and "api-version=" not in query:
                    self.transport.write(_error(404, "Azure paths need an api-version"))
                    continue
                await self._complete(path.endswith("chat/completions"), body)
            else:
                self.transport.write(_error(404, f"no route {method} {path}"))

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if not self.settings.keys or self.transport is None:
            return True
        given = headers.get(b"authorization", b"").removeprefix(b"Bearer ").decode()
        given = given or headers.get(b"api-key", headers.get(b"x-api-key", b"")).decode()
        if given in self.settings.keys:
            return True
        shown = f"{given[:3]}****{given[-4:]}" if given else "(none)"
        self.transport.write(_error(401, f"Incorrect API key provided: {shown}."))
        return False

    async def _anthropic(self, body: bytes) -> None:
        """Anthropic's Messages API, just enough for litellm's translation."""
        if self.transport is None:
            return
        req = json.loads(body or b"{}")
        n = max(
            1, min(int(req.get("max_tokens") or self.settings.chunks), self.settings.max_chunks)
        )
        rid = f"msg_{os.urandom(6).hex()}"
        model = req.get("model") or self.settings.model
        usage = {"input_tokens": len(json.dumps(req.get("messages"))) // 4 + 1, "output_tokens": n}
        if not req.get("stream"):
            message = {
                "id": rid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [{"type": "text", "text": " tok" * n}],
                "stop_reason": "max_tokens",
                "stop_sequence": None,
                "usage": usage,
            }
            self.transport.write(_response(200, json.dumps(message).encode()))
            return
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        )

        def event(kind: str, data: dict[str, object]) -> None:
            payload = json.dumps({"type": kind, **data}).encode()
            self._write_chunk(b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n")

        start: dict[str, object] = {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0},
        }
        event("message_start", {"message": start})
        event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        for _ in range(n):
            event("content_block_delta",
                  {"index": 0, "delta": {"type": "text_delta", "text": " tok"}})  # fmt: skip
        event("content_block_stop", {"index": 0})
        event("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                "usage": {"output_tokens": n}})  # fmt: skip
        event("message_stop", {})
        self.transport.write(b"0\r\n\r\n")

    def _read_request(self, body: bytes) -> dict[str, Any] | None:
        """The request to answer, or None once an error answer is written (the first
        ``fail_first`` requests, a body that is not a JSON object, a ``fake_status``)."""
        assert self.transport is not None
        self.settings.served += 1
        if self.settings.served <= self.settings.fail_first:
            self.transport.write(_error(503, "fake upstream fails its first requests"))
            return None
        try:
            req = json.loads(body or b"{}")
            if not isinstance(req, dict):
                raise ValueError
        except ValueError:
            self.transport.write(_error(400, "body is not a JSON object"))
            return None
        status = int(req.get("fake_status", self.settings.status))
        if status != 200:
            self.transport.write(_error(status, f"fake upstream answers {status}"))
            return None
        return req

    async def _complete(self, chat: bool, body: bytes) -> None:
        if self.transport is None:
            return
        req = self._read_request(body)
        if req is None:
            return
        n = req.get("max_tokens") or req.get("max_completion_tokens") or self.settings.chunks
        n = max(1, min(int(n), self.settings.max_chunks))
        delay = float(req.get("fake_chunk_delay_ms", self.settings.chunk_delay_ms)) / 1000.0
        model = req.get("model") or self.settings.model
        prompt_tokens = len(json.dumps(req.get("messages") or req.get("prompt") or "")) // 4 + 1
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        }
        rid = f"fake-{os.urandom(6).hex()}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not req.get("stream"):
            if delay:
                await asyncio.sleep(delay * n)
            head = {"id": rid, "object": obj, "created": created, "model": model}
            payload = _whole_answer(chat, n, head)
            if self.settings.usage:
                payload["usage"] = usage
            self.transport.write(_response(200, json.dumps(payload).encode()))
            return
        include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        include_usage = include_usage and self.settings.usage
        # vLLM's continuous_usage_stats (what the gateway asks engines for): usage so far on
        # every chunk
        continuous = include_usage and bool(req["stream_options"].get("continuous_usage_stats"))
        sent = 0
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, object]], extra: dict[str, object] | None = None) -> None:
            data = {
                "id": rid,
                "object": chunk_obj,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if continuous:
                data["usage"] = {
                    **usage,
                    "completion_tokens": sent,
                    "total_tokens": prompt_tokens + sent,
                }
            if extra:
                data.update(extra)
            self._write_chunk(b"data: " + json.dumps(data).encode() + b"\n\n")

        if chat:
            event(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
        for i in range(n):
            if delay:
                await asyncio.sleep(delay)
            if self.transport.is_closing():
                return
            sent = i + 1
            last = i == n - 1
            finish = "length" if last else None
            choice = (
                {"index": 0, "delta": {"content": " tok"}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": " tok", "finish_reason": finish}
            )
            event([choice])
        if include_usage:
            event([], {"usage": usage})
        self._write_chunk(b"data: [DONE]\n\n")
        self.transport.write(b"0\r\n\r\n")

    def _write_chunk(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))


async def serve(
    settings: FakeSettings,
    host: str = "127.0.0.1",
    port: int = 0,
    uds: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> asyncio.base_events.Server:
    """Start the fake; returns the asyncio server (its sockets tell the bound port)."""
    loop = asyncio.get_running_loop()
    if uds:
        return await loop.create_unix_server(lambda: FakeUpstreamProtocol(settings), uds)
    return await loop.create_server(
        lambda: FakeUpstreamProtocol(settings),
        host,
        port,
        reuse_address=True,
        backlog=2048,
        ssl=ssl_context,
    )


def server_ssl_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    if client_ca:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fast fake OpenAI-compatible upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--uds", default=None)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--max-chunks", type=int, default=4096)
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0)
    parser.add_argument("--status", type=int, default=200)
    parser.add_argument("--tls-cert", default=None)
    parser.add_argument("--tls-key", default=None)
    parser.add_argument("--tls-client-ca", default=None)
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--require-key", nargs="+", default=[])
    parser.add_argument("--fail-first", type=int, default=0)
    args = parser.parse_args(argv)
    settings = FakeSettings(
        model=args.model,
        chunks=args.chunks,
        max_chunks=args.max_chunks,
        chunk_delay_ms=args.chunk_delay_ms,
        status=args.status,
        usage=not args.no_usage,
        keys=tuple(args.require_key),
        fail_first=args.fail_first,
    )
    tls = (
        server_ssl_context(args.tls_cert, args.tls_key, args.tls_client_ca)
        if args.tls_cert
        else None
    )

    async def run() -> None:
        try:
            import uvloop  # noqa: F401  (installed with uvicorn[standard])
        except ImportError:
            pass
        server = await serve(settings, args.host, args.port, args.uds, tls)
        # What start-up loaded lives as long as the process: full collections skip it, so the
        # fake never pauses tens of ms in the middle of a benchmark (gc.freeze).
        gc.collect()
        gc.freeze()
        where = args.uds or f"{args.host}:{server.sockets[0].getsockname()[1]}"
        print(f"fake upstream listening on {where}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
