"""``portico engine``: serve one model behind an OpenAI-compatible API (like ``vllm serve``).

Flags: every engine flag of :class:`~engine.config.EngineConfig` (vLLM's names) plus the
server's own: ``--host/--port`` or ``--uds``, ``--api-key`` (or ``PORTICO_ENGINE_API_KEY``),
``--drain-timeout``, ``--max-body-bytes``, ``--health-stall-timeout``, and tool calling's
``--tool-call-parser`` / ``--enable-auto-tool-choice`` (vLLM's names and meaning).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys

from engine.server.settings import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_STALL_TIMEOUT_S,
    ServerSettings,
)
from engine.server.tool_parsers import TOOL_PARSERS
from portico.media_fetch import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_MEDIA_BYTES,
    MediaPolicy,
    parse_networks,
)

API_KEY_ENV = "PORTICO_ENGINE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.config import EngineConfig

    EngineConfig.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="listen on this Unix socket instead of host:port",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="seconds SIGTERM waits for in-flight requests (default 30)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted (default 4 MiB)",
    )
    g.add_argument(
        "--health-stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="seconds without engine progress, with work pending, before /health "
        "turns 503 (default 60)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="parser that extracts tool calls from replies to tool_choice='auto' "
        "(hermes: <tool_call>JSON</tool_call> blocks)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="allow tool_choice='auto' (the model decides whether to call tools); "
        "needs --tool-call-parser",
    )
    _add_media_arguments(g)
    g.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")


def _add_media_arguments(g: argparse._ArgumentGroup) -> None:
    """The image-URL fetching flags (vLLM's ``--allowed-media-domains`` and its limits)."""
    g.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="host names whose http(s) image URLs this server fetches (exact names; default "
        "none: an image URL is a 400); private, loopback, link-local, multicast and reserved "
        "addresses are refused unless --allowed-media-networks holds them. Behind the "
        "gateway this is not needed: the gateway fetches and sends data URLs",
    )
    g.add_argument(
        "--allowed-media-networks",
        nargs="+",
        default=[],
        metavar="CIDR",
        help="private networks an allowed host may resolve to, e.g. 10.0.0.0/8 (default none)",
    )
    g.add_argument(
        "--max-media-bytes",
        type=int,
        default=DEFAULT_MAX_MEDIA_BYTES,
        help="the most bytes one fetched image may have, counted while reading (default 5 MiB)",
    )
    g.add_argument(
        "--media-fetch-timeout-s",
        type=float,
        default=DEFAULT_FETCH_TIMEOUT_S,
        help="the most seconds one image fetch may take, redirects included (default 5)",
    )


def _check_server_args(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    if args.drain_timeout < 0:
        return f"--drain-timeout must be >= 0, got {args.drain_timeout}"
    if args.max_body_bytes < 1:
        return f"--max-body-bytes must be >= 1, got {args.max_body_bytes}"
    if args.health_stall_timeout <= 0:
        return f"--health-stall-timeout must be > 0, got {args.health_stall_timeout}"
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        return "--enable-auto-tool-choice needs --tool-call-parser"
    if args.max_media_bytes < 1024 or args.media_fetch_timeout_s <= 0:
        return "--max-media-bytes must be >= 1024 and --media-fetch-timeout-s > 0"
    try:
        parse_networks(args.allowed_media_networks)
    except ValueError as exc:
        return f"--allowed-media-networks: {exc}"
    return None


def server_settings(args: argparse.Namespace, model_name: str) -> ServerSettings:
    """The server's settings from parsed flags (``--api-key`` wins over the environment)."""
    return ServerSettings(
        served_model_name=model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
        stall_timeout_s=args.health_stall_timeout,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        media=MediaPolicy.of(
            args.allowed_media_domains,
            args.allowed_media_networks,
            args.max_media_bytes,
            args.media_fetch_timeout_s,
        ),
    )


def _stop_while_loading(signum: int, frame: object) -> None:
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGTERM has drained the server, exit (0 after a drain)."""
    # A supervisor may stop us while the model loads: that is a clean stop, not a crash.
    signal.signal(signal.SIGTERM, _stop_while_loading)
    from engine.config import EngineConfig
    from portico.registry import ModelNotFound, resolve

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    problem = _check_server_args(args)
    try:
        if problem:
            raise ValueError(problem)
        config = EngineConfig.from_cli_args(args)
        resolve(config.model)  # fail fast, before the heavy imports
    except (ValueError, ModelNotFound) as exc:
        print(f"portico engine: {exc}", file=sys.stderr)
        return 2

    from engine.async_engine import AsyncLLMEngine
    from engine.server.app import create_app
    from engine.server.runner import serve

    try:
        engine = AsyncLLMEngine.from_config(config)
    except (ValueError, ModelNotFound) as exc:
        print(f"portico engine: {exc}", file=sys.stderr)
        return 2
    if engine.engine.parallel is not None:  # a dead worker: exit now, the supervisor restarts us
        from engine.distributed.leader import exit_process

        engine.engine.parallel.on_worker_death = exit_process
    from engine.server.tracing import EngineTracing

    tracing = EngineTracing.from_env(os.environ)  # None unless OTEL_* asks for traces
    app = create_app(engine, server_settings(args, config.model_name), tracing)
    # Like vLLM: move the model's long-lived objects out of the collector's reach, so
    # serving-time collections do not walk them again and again.
    gc.collect()
    gc.freeze()
    code = serve(
        app,
        app.state.drain,
        host=args.host,
        port=args.port,
        uds=args.uds,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
        access_log=args.access_log,
        cut_in_flight=engine.shutdown,
    )
    engine.engine.close()  # tensor-parallel workers: stopped and reaped
    if tracing is not None:
        tracing.shutdown()  # export what is buffered before leaving
    # Everything is shut down (engine loop joined, socket removed). Tearing the interpreter
    # down would only spend seconds collecting the model's objects and make Triton's bindings
    # report them as leaks, so leave now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
