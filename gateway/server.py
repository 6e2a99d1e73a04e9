"""Running the gateway: uvicorn with TLS, and the drain on SIGTERM.

First SIGTERM (or SIGINT): the gateway drains — ``/ready`` answers 503 and new requests get 503
while in-flight requests, streams included, run to completion for up to ``drain_timeout_s``;
then uvicorn stops, and the app's lifespan sends SIGTERM to the engines and waits for them to
drain. The process exits 0. A second signal forces the shutdown: engines are killed and the
process exits 1 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
from types import FrameType
from typing import Any

import uvicorn

from gateway.config import GatewayConfig
from gateway.http_protocol import LimitedHeadersProtocol
from gateway.request_path import Gateway
from gateway.tls import Tls12Config

log = logging.getLogger("portico.gateway.server")


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the gateway's two-stage shutdown."""

    def __init__(self, config: uvicorn.Config, app: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._app = app
        self.drain_timeout_s = drain_timeout_s
        self.forced = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    @property
    def gateway(self) -> Gateway:
        """The app's gateway; it exists once the server has started (the lifespan built it)."""
        gateway: Gateway = self._app.state.gateway
        return gateway

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler; never re-raised later (uvicorn would die by the signal).
        if self._loop is None or not self.started:
            self.should_exit = True
            return
        if self._drain_task is not None or self.should_exit:
            log.warning("second signal: forcing the shutdown")
            self.forced = True
            self.should_exit = self.force_exit = True
            self._kill_engines()
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self.gateway.begin_drain()
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self.gateway.in_flight.wait_idle(), self.drain_timeout_s)
            log.info("drained: no request in flight")
        except asyncio.TimeoutError:
            log.error(
                "drain timeout (%.0f s): %d request(s) cut short",
                self.drain_timeout_s,
                self.gateway.in_flight.count,
            )
        self.should_exit = True

    def _kill_engines(self) -> None:
        for proc in self.gateway.supervisor.processes:
            if proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)


def uvicorn_config(app: Any, config: GatewayConfig) -> uvicorn.Config:
    """uvicorn settings from the gateway config: listen address, TLS, lean HTTP stack."""
    kwargs: dict[str, Any] = {}
    tls = config.tls
    if tls is not None:
        kwargs.update(
            ssl_certfile=str(tls.cert_file),
            ssl_keyfile=str(tls.key_file),
            ssl_keyfile_password=os.environ.get(tls.key_password_env)
            if tls.key_password_env
            else None,
        )
        if tls.client_ca_file is not None:
            kwargs.update(ssl_ca_certs=str(tls.client_ca_file), ssl_cert_reqs=ssl.CERT_OPTIONAL)
    server_config = Tls12Config(
        app,
        host=config.listen.host,
        port=config.listen.port,
        lifespan="on",
        http=LimitedHeadersProtocol,
        loop="uvloop",
        log_config=None,
        access_log=config.access_log,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
        server_header=False,
        **kwargs,
    )
    server_config.max_header_line_bytes = config.max_header_line_bytes  # type: ignore[attr-defined]
    server_config.max_header_bytes = config.max_header_bytes  # type: ignore[attr-defined]
    return server_config


def serve(app: Any, config: GatewayConfig) -> int:
    """Run until shut down; 0 after a drain, 1 when forced by a second signal."""
    server = DrainingServer(uvicorn_config(app, config), app, config.drain_timeout_s)
    server.run()
    if server.forced:
        return 1
    return 0 if server.started else 1
