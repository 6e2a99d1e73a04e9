"""A real local HTTP server of images for the media-fetch tests (tests/test_media_fetch.py,
tests/gateway/dataplane/test_gateway_image_urls.py), on 127.0.0.1 in a thread.

Paths: ``/cat.png`` (a PNG), ``/to-cat`` (302 to ``/cat.png``), ``/loop`` (302 to itself),
``/away`` (302 to ``http://elsewhere.invalid/cat.png``), ``/big.png`` (a PNG signature then
``BIG_BYTES`` more, with no Content-Length: the cap must be found while reading),
``/slow.png`` (waits ``SLOW_S`` before answering), ``/page`` (HTML, not an image),
``/missing`` (404). ``hits`` counts the requests per path.
"""

from __future__ import annotations

import http.server
import io
import threading
import time
from collections import Counter

import torch
from PIL import Image

BIG_BYTES = 2 * 2**20
SLOW_S = 6.0


def png(seed: int = 5) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (30, 40, 3), generator=generator, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


class MediaServer:
    """Start with :meth:`start`; ``url(path)`` is ``http://<host>:<port><path>``."""

    def __init__(self, image: bytes) -> None:
        self.image = image
        self.hits: Counter[str] = Counter()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes

            def do_GET(self) -> None:
                server.hits[self.path] += 1
                redirects = {
                    "/to-cat": "/cat.png",
                    "/loop": "/loop",
                    "/away": "http://elsewhere.invalid/cat.png",
                }
                if self.path in redirects:
                    self.send_response(302)
                    self.send_header("Location", redirects[self.path])
                    self.end_headers()
                elif self.path == "/cat.png":
                    self._send(server.image, "image/png")
                elif self.path == "/big.png":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    try:
                        self.wfile.write(server.image[:8])
                        for _ in range(BIG_BYTES // 65536):
                            self.wfile.write(b"\0" * 65536)
                    except OSError:
                        pass  # the fetcher hung up at its cap
                elif self.path == "/slow.png":
                    time.sleep(SLOW_S)
                    self._send(server.image, "image/png")
                elif self.path == "/page":
                    self._send(b"<html><body>no picture</body></html>", "text/html")
                else:
                    self.send_error(404)

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]

    def start(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def url(self, path: str, host: str = "localhost") -> str:
        return f"http://{host}:{self.port}{path}"
