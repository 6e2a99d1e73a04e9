"""Run the app under uvicorn with Portico's own SIGTERM handling (graceful drain).

uvicorn's handler closes the listening socket and then waits for connections, which cuts the
SSE streams of a draining engine short of their end and re-raises the signal afterwards (a
non-zero exit). :class:`DrainingServer` instead flips the app's :class:`DrainState` (``/ready``
turns 503, new requests get 503), waits up to the drain timeout for in-flight requests to
finish, then lets uvicorn stop; the process exits 0. Requests still running at the timeout are
cut by ``cut_in_flight`` (the engine's shutdown: streams end with an error event). A second
SIGTERM or SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Generator
from pathlib import Path

import uvicorn

from engine.server.drain import DrainState

logger = logging.getLogger("portico.engine.server")

CUT_GRACE_S = 5.0  # after the drain timeout, time for cut requests to send their last bytes


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGTERM/SIGINT start a drain instead of an immediate stop."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: DrainState,
        drain_timeout_s: float,
        cut_in_flight: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s
        self.cut_in_flight = cut_in_flight
        self._drain_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        handled = (signal.SIGTERM, signal.SIGINT)
        for sig in handled:
            loop.add_signal_handler(sig, self.on_signal, sig)
        try:
            yield
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    def on_signal(self, sig: int) -> None:
        if self._drain_task is not None:
            logger.warning("second %s: stopping now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True
            return
        logger.info("%s: draining (up to %g s)", signal.Signals(sig).name, self.drain_timeout_s)
        self._drain_task = asyncio.ensure_future(self.drain_then_exit())

    async def drain_then_exit(self) -> None:
        self.drain.start_draining()
        if await self.drain.wait_idle(self.drain_timeout_s):
            logger.info("drained: no request in flight")
        else:
            logger.warning(
                "drain timeout: %d request(s) still in flight are cut", self.drain.in_flight
            )
            if self.cut_in_flight is not None:
                # Streams then end with an error event and [DONE] instead of a torn connection.
                await self.cut_in_flight()
                await self.drain.wait_idle(CUT_GRACE_S)
        self.should_exit = True


def bind_unix_socket(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` readable only by this user (0600)."""
    target = Path(path)
    if target.is_socket():
        target.unlink()  # a stale socket from a previous run
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(target))
    finally:
        os.umask(old_umask)
    sock.listen(2048)
    return sock


def serve(
    app: object,
    drain: DrainState,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    uds: str | None = None,
    drain_timeout_s: float = 30.0,
    log_level: str = "info",
    access_log: bool = False,
    cut_in_flight: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Serve ``app`` until a signal drains it; returns the process exit code."""
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = DrainingServer(config, drain, drain_timeout_s, cut_in_flight)
    sockets = [bind_unix_socket(uds)] if uds else None
    try:
        server.run(sockets=sockets)
    finally:
        if uds:
            with contextlib.suppress(OSError):
                Path(uds).unlink()
    return 0 if server.started else 1
