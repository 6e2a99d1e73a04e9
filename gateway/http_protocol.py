"""The gateway's HTTP/1.1 protocol: uvicorn's httptools parser with header size limits.

Without nginx in front, the gateway is the edge, so it must refuse what nginx would: a header
line over ``max_header_line_bytes`` or a header block over ``max_header_bytes`` gets 431
(RFC 6585) and the connection is closed before the app sees the request. The block is counted
as bytes arrive, so a client cannot make the parser buffer a megabyte header it never ends.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.tls import TLSScopeProtocol
from portico.errors import error_body

DEFAULT_MAX_HEADER_LINE_BYTES = 8 * 1024  # nginx's large_client_header_buffers: 8k a line
DEFAULT_MAX_HEADER_BYTES = 32 * 1024  # ... and 4 of them


class LimitedHeadersProtocol(TLSScopeProtocol):
    """``TLSScopeProtocol`` that answers 431 for an oversized header line or header block.

    The limits are read from the uvicorn config (``max_header_line_bytes``,
    ``max_header_bytes`` attributes set by gateway.server); the defaults are nginx's. A parser
    callback that finds a limit crossed records why and fails the parse; uvicorn then answers
    the parse error through ``send_400_response``, which sends the 431 instead.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._max_line = int(
            getattr(config, "max_header_line_bytes", DEFAULT_MAX_HEADER_LINE_BYTES)
        )
        self._max_block = int(getattr(config, "max_header_bytes", DEFAULT_MAX_HEADER_BYTES))
        self._too_large: str | None = None
        self._in_head = True
        self._head_bytes = 0
        self._block_bytes = 0

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and self._too_large is None and not self.transport.is_closing():
            # an unfinished head: the parser buffers it, so bound it as it grows
            self._head_bytes += len(data)
            if self._head_bytes > self._max_line + self._max_block:
                self._send_431(f"The request's headers are over {self._max_block} bytes.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._block_bytes = 0

    def _refuse(self, message: str) -> None:
        self._too_large = message
        raise ValueError(message)  # fails feed_data; uvicorn calls send_400_response

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self._max_line:
            self._refuse(f"The request line is over {self._max_line} bytes.")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        line = len(name) + len(value) + 4  # "name: value\r\n"
        if line > self._max_line:
            self._refuse(f"A request header line is over {self._max_line} bytes.")
        self._block_bytes += line
        if self._block_bytes > self._max_block:
            self._refuse(f"The request's headers are over {self._max_block} bytes.")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._too_large is not None:
            self._send_431(self._too_large)
        else:
            super().send_400_response(msg)

    def _send_431(self, message: str) -> None:
        body = json.dumps(
            error_body(message, "invalid_request_error", code="request_header_fields_too_large")
        ).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body
        )
        self.transport.close()
