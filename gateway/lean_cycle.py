"""uvicorn's request-response cycle, cheaper on the way out, for the hot routes.

:class:`LeanCycle` is uvicorn's ``RequestResponseCycle`` with two changes to ``send``, and the
same bytes on the wire:

- The response head's names and values are checked by one regular-expression search over all
  names and one over all values (uvicorn's own patterns, which match single bytes, so a search
  over the joined bytes finds a bad byte exactly when one header's search would), instead of
  two searches per header. A head that fails goes through uvicorn's own loop, which raises its
  error for the first bad header.
- The head is held until the first body message and leaves with it in one ``write`` (one
  ``send`` system call where there were two). An app that ends, or fails, before sending a body
  has its head written first, as uvicorn would have; any message but a body, a paused writer
  or a client gone also writes the held head before uvicorn's ``send`` goes on.

Only the fast, common case is written here; everything else (the access log, flow control, a
disconnected client, messages after the first body) is uvicorn's ``send``. The gateway's
protocol (``gateway/http_protocol.py``) gives the hot routes this cycle; the hot routes send
the body right after the head (a relayed stream sends its first block, empty or not).
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

# the headers that change the framing or the connection: checked by name, as uvicorn does
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection"))


class LeanCycle(RequestResponseCycle):
    """uvicorn's cycle with a cheaper head (see the module). Swapped in by class before the
    cycle's task starts; ``held`` is the head waiting for its body (empty: none)."""

    held: bytes = b""

    async def run_asgi(self, app: Any) -> None:
        # uvicorn's run_asgi, with the held head written before its handling of the end
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            self._write_held()
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self.send_500_response()
            else:
                self.transport.close()
        else:
            self._write_held()
            if result is not None:
                msg = "ASGI callable should return None, but returned '%s'."
                self.logger.error(msg, result)
                self.transport.close()
            elif not self.response_started and not self.disconnected:
                self.logger.error("ASGI callable returned without starting response.")
                await self.send_500_response()
            elif not self.response_complete and not self.disconnected:
                self.logger.error("ASGI callable returned without completing response.")
                self.transport.close()
        finally:
            self.on_response = lambda: None

    async def send(self, message: Any) -> None:
        if self.held:
            if (
                message["type"] == "http.response.body"
                and not self.flow.write_paused
                and not self.disconnected
            ):
                self._send_first_body(message)
                return
            self._write_held()
        elif (
            not self.response_started
            and message["type"] == "http.response.start"
            and not self.access_log
            and not self.disconnected
            and not self.flow.write_paused
        ):
            head = self._head(message)
            if head is not None:
                self.held = head
                return
        await super().send(message)

    def _write_held(self) -> None:
        held, self.held = self.held, b""
        if held and not self.disconnected:
            self.transport.write(held)

    def _head(self, message: Any) -> bytes | None:
        """The response head's bytes, its state kept on the cycle as uvicorn keeps it; None
        (nothing kept) for a head uvicorn's own loop must judge."""
        status = message["status"]
        content = [STATUS_LINE[status]]
        chunked: bool | None = None
        expected = 0
        keep_alive = self.keep_alive
        close_sent = False
        try:
            for name, value in self.default_headers + list(message.get("headers", [])):
                name = name.lower()
                if name in _FRAMING:
                    if name == b"content-length":
                        if chunked is None:
                            expected = int(value.decode())
                            chunked = False
                    elif name == b"transfer-encoding":
                        if value.lower() == b"chunked":
                            expected = 0
                            chunked = True
                    elif b"close" in [token.lower().strip() for token in value.split(b",")]:
                        keep_alive = False
                        close_sent = True
                content += (name, b": ", value, b"\r\n")
        except (ValueError, TypeError, AttributeError):
            return None
        if HEADER_RE.search(b"".join(content[1::4])) or HEADER_VALUE_RE.search(
            b"".join(content[3::4])
        ):
            return None
        if not keep_alive and not close_sent:
            content.append(b"connection: close\r\n")
        if chunked is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self.response_started = True
        self.waiting_for_100_continue = False
        self.chunked_encoding = chunked
        self.expected_content_length = expected
        self.keep_alive = keep_alive
        return b"".join(content)

    def _send_first_body(self, message: Any) -> None:
        """The held head and the first body message in one write (uvicorn's body branch)."""
        head, self.held = self.held, b""
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
            self.transport.write(head)
        elif self.chunked_encoding:
            data = b"%s%x\r\n%s\r\n" % (head, len(body), body) if body else head
            self.transport.write(data if more_body else data + b"0\r\n\r\n")
        else:
            if len(body) > self.expected_content_length:
                self.transport.write(head)
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            self.transport.write(head + body)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()
