"""What ``portico serve`` runs its HTTP stack on with the packaged config (gateway/server.py):
the defaults are the lean settings the gateway benchmark measures (docs/benchmarks.md, "The
gateway's defaults"), and a config that asks for the access log gets it."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import GatewayConfig
from gateway.server import uvicorn_config


async def _app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("never called: only the server's settings are read")


def test_the_packaged_config_serves_on_uvloop_and_httptools_without_an_access_log() -> None:
    config = GatewayConfig()  # `make run`: portico serve with no config file
    settings = uvicorn_config(_app, config)
    settings.load()  # what uvicorn resolves at start: fails if uvloop or httptools is missing
    assert settings.loop == "uvloop" and settings.access_log is False
    loop = settings.get_loop_factory()  # imports uvloop, as uvicorn does at start
    assert loop is not None
    event_loop = loop()
    try:
        assert type(event_loop).__module__.startswith("uvloop")
    finally:
        event_loop.close()
    assert isinstance(settings.http_protocol_class, type)
    assert issubclass(settings.http_protocol_class, HttpToolsProtocol)
    assert config.log_level == "info"


def test_a_config_that_asks_for_the_access_log_gets_it() -> None:
    settings = uvicorn_config(_app, GatewayConfig(access_log=True))
    assert settings.access_log is True
