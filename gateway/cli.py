"""``portico serve``: the gateway and the engines it supervises, from one config file."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from pathlib import Path

ADMIN_KEY_FILENAME = "admin_key"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        type=Path,
        default=None,
        help="gateway config (YAML); default: serve smollm2-135m as 'smollm2' "
        "with one engine and the embedded Redis",
    )
    parser.add_argument("--host", default=None, help="override listen.host")
    parser.add_argument("--port", type=int, default=None, help="override listen.port")
    parser.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="override log_level",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="override media.allowed_domains: host names whose http(s) image URLs the gateway "
        "fetches for local engines (exact names; default none: image URLs to local engines "
        "are a 400); private, loopback and reserved addresses are refused unless "
        "--allowed-media-networks holds them",
    )
    parser.add_argument(
        "--allowed-media-networks",
        nargs="+",
        default=None,
        metavar="CIDR",
        help="override media.allowed_networks: private networks an allowed host may resolve "
        "to, e.g. 10.0.0.0/8 for an internal CDN (default none)",
    )
    parser.add_argument(
        "--max-media-bytes",
        type=int,
        default=None,
        help="override media.max_bytes: the most bytes one fetched image may have "
        "(default 5 MiB; counted while reading)",
    )
    parser.add_argument(
        "--media-fetch-timeout-s",
        type=float,
        default=None,
        help="override media.fetch_timeout_s: the most seconds one image fetch may take, "
        "redirects included (default 5)",
    )


def _first_start_admin_key(config: object) -> tuple[Path, bool] | None:
    """With no admin key configured anywhere, use one generated under the data dir (mode
    0600). Returns (path, created now) or None when a key is configured."""
    auth = config.auth  # type: ignore[attr-defined]
    if auth.admin_key_file is not None or os.environ.get("PORTICO_ADMIN_KEY"):
        return None
    data_dir: Path = config.redis.data_dir  # type: ignore[attr-defined]
    path = data_dir / ADMIN_KEY_FILENAME
    created = not path.exists()
    if created:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("sk-admin-" + secrets.token_urlsafe(32) + "\n")
    auth.admin_key_file = path
    return path, created


def _print_first_start(key_file: Path, base: str) -> None:
    admin = '-H "authorization: Bearer $PORTICO_ADMIN_KEY" -H "content-type: application/json"'
    tenant = '{"id": "acme", "name": "Acme"}'
    print(
        f"admin key generated: {key_file.resolve()} (set PORTICO_ADMIN_KEY to use your own)\n"
        f"create a tenant and an API key:\n"
        f"  export PORTICO_ADMIN_KEY=$(cat {key_file.resolve()})\n"
        f"  curl -s {base}/admin/v1/tenants {admin} -d '{tenant}'\n"
        f"  curl -s {base}/admin/v1/tenants/acme/keys {admin} -d '{{}}'   # shows the key once",
        file=sys.stderr,
        flush=True,
    )


def _missing_models(config: object) -> list[str]:
    """``engines.N.model: ...`` for every engine model that is not on this machine."""
    from portico import registry

    missing = []
    for i, spec in enumerate(config.engines):  # type: ignore[attr-defined]
        if spec.command is not None or spec.discovery is not None:
            continue  # a custom command, or engines elsewhere, resolve their own model
        try:
            registry.resolve(spec.model)
        except registry.ModelNotFound as exc:
            missing.append(f"engines.{i}.model: {exc}")
    return missing


def _override_media(config: object, args: argparse.Namespace) -> None:
    """The ``--*media*`` flags over the config file's ``media:``, validated as the file is."""
    from gateway.body.image_parts import MediaSettings
    from gateway.config import ConfigError

    media = config.media  # type: ignore[attr-defined]
    given = {
        "allowed_domains": getattr(args, "allowed_media_domains", None),
        "allowed_networks": getattr(args, "allowed_media_networks", None),
        "max_bytes": getattr(args, "max_media_bytes", None),
        "fetch_timeout_s": getattr(args, "media_fetch_timeout_s", None),
    }
    changes = {k: v for k, v in given.items() if v is not None}
    if not changes:
        return
    try:
        merged = MediaSettings.model_validate({**media.model_dump(), **changes})
    except ValueError as exc:
        raise ConfigError(f"invalid media flags: {exc}") from None
    config.media = merged  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError, load_config

    try:
        config = load_config(args.config)
        if args.host is not None:
            config.listen.host = args.host
        if args.port is not None:
            config.listen.port = args.port
        if args.log_level is not None:
            config.log_level = args.log_level
        _override_media(config, args)
    except ConfigError as exc:
        print(f"portico serve: {exc}", file=sys.stderr)
        return 2
    missing = _missing_models(config)
    if missing:
        print("portico serve: " + "\n  ".join(["models not found:", *missing]), file=sys.stderr)
        return 2
    from gateway.store import DataDirBusy, DataDirLock

    try:
        # held until the process exits: one gateway per data dir
        lock = DataDirLock.acquire(config.redis.data_dir, config.listen.port)
    except DataDirBusy as exc:
        print(f"portico serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call is noise
    generated = _first_start_admin_key(config)
    scheme = "https" if config.tls is not None else "http"
    base = f"{scheme}://{config.listen.host}:{config.listen.port}"
    if generated is not None:
        key_file, created = generated
        if created:
            _print_first_start(key_file, base)
        else:
            print(f"admin key: {key_file.resolve()}", file=sys.stderr, flush=True)
    from gateway.app import create_app
    from gateway.server import serve

    try:
        return serve(create_app(config), config)
    finally:
        lock.release()
