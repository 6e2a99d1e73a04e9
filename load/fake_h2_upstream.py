"""A fake OpenAI-compatible upstream that speaks only HTTP/2 over TLS (ALPN ``h2``).

For the test that proves ``remotes[].http2`` really talks HTTP/2: a client that cannot speak
it gets no answer here. Completions (chat or not, streamed or not) answer ``max_tokens`` copies
of ``" tok"`` with usage, like ``load/fake_upstream.py``; the ``model`` of each answer is
``"h2:" + the requested model``, so a test can see which server answered.

    python -m load.fake_h2_upstream --port 9443 --tls-cert server.pem --tls-key server.pem
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import ssl

import h2.config
import h2.connection
import h2.events


class H2Protocol(asyncio.Protocol):
    """One HTTP/2 connection: requests collected per stream, answered when they end."""

    def __init__(self) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config=config)
        self.transport: asyncio.Transport | None = None
        self.requests: dict[int, tuple[dict[str, str], bytearray]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.conn.initiate_connection()
        self._flush()

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.requests[event.stream_id] = (dict(event.headers), bytearray())  # type: ignore[arg-type]
            elif isinstance(event, h2.events.DataReceived) and event.stream_id in self.requests:
                self.requests[event.stream_id][1].extend(event.data)
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id in self.requests:
                self._answer(event.stream_id, *self.requests.pop(event.stream_id))
        self._flush()

    def _flush(self) -> None:
        if self.transport is not None:
            self.transport.write(self.conn.data_to_send())

    def _answer(self, stream_id: int, headers: dict[str, str], body: bytearray) -> None:
        path = headers.get(":path", "")
        if headers.get(":method") != "POST" or not path.endswith("/completions"):
            self._send(stream_id, 404, b'{"error":{"message":"no route","type":"fake"}}')
            return
        req = json.loads(body or b"{}")
        chat = path.endswith("/chat/completions")
        n = max(1, int(req.get("max_tokens") or 8))
        model = "h2:" + str(req.get("model"))
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        if not req.get("stream"):
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": " tok" * n},
                 "finish_reason": "length"}
                if chat
                else {"index": 0, "text": " tok" * n, "finish_reason": "length"}
            )  # fmt: skip
            kind = "chat.completion" if chat else "text_completion"
            answer = {"id": "h2", "object": kind, "created": 0, "model": model,
                      "choices": [choice], "usage": usage}  # fmt: skip
            self._send(stream_id, 200, json.dumps(answer).encode())
            return
        events = []
        for i in range(n):
            finish = "length" if i == n - 1 else None
            choice = (
                {"index": 0, "delta": {"content": " tok"}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": " tok", "finish_reason": finish}
            )
            events.append({"id": "h2", "object": "chunk", "created": 0, "model": model,
                           "choices": [choice]})  # fmt: skip
        if (req.get("stream_options") or {}).get("include_usage"):
            events.append({"id": "h2", "object": "chunk", "created": 0, "model": model,
                           "choices": [], "usage": usage})  # fmt: skip
        sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        self._send(stream_id, 200, sse + b"data: [DONE]\n\n", "text/event-stream")

    def _send(
        self, stream_id: int, status: int, body: bytes, content_type: str = "application/json"
    ) -> None:
        self.conn.send_headers(
            stream_id,
            [(":status", str(status)), ("content-type", content_type),
             ("content-length", str(len(body)))],
        )  # fmt: skip
        self.conn.send_data(stream_id, body, end_stream=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fake OpenAI-compatible upstream, HTTP/2 only")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tls-cert", required=True)
    parser.add_argument("--tls-key", required=True)
    args = parser.parse_args(argv)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.tls_cert, args.tls_key)
    ctx.set_alpn_protocols(["h2"])

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(H2Protocol, args.host, args.port, ssl=ctx)
        print(f"fake h2 upstream listening on {args.host}:{args.port}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
