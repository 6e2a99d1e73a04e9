"""What the engine server needs besides the engine: names, limits, credentials, timeouts."""

from __future__ import annotations

from dataclasses import dataclass

from portico.media_fetch import MediaPolicy

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_STALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServerSettings:
    """Settings of one engine server process (frozen: read once at startup).

    ``api_key`` None means no authentication. ``stall_timeout_s`` is how long the engine loop
    may go without progress while requests are pending before ``/health`` reports it stalled.
    ``tool_call_parser`` names the parser of :data:`~engine.server.tool_parsers.TOOL_PARSERS`
    that reads replies to ``tool_choice="auto"``, which ``enable_auto_tool_choice`` allows.
    ``media`` says which ``http(s)`` image URLs the server fetches (``--allowed-media-domains``;
    default none).
    """

    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    media: MediaPolicy = MediaPolicy()
