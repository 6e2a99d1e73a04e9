"""``portico keys``: manage tenants, API keys, their limits and money budgets, and the
models' prices through the gateway's admin API.

A thin httpx client of ``/admin/v1``; it never touches Redis itself. The admin credential
comes from ``--admin-key-file``, ``--admin-key`` or ``$PORTICO_ADMIN_KEY`` (prefer the file or
the environment: arguments show up in ``ps``), else from ``.portico/admin_key``, the key
``portico serve`` generates on its first start in this folder when none is configured. Every
command prints the API's JSON answer; ``keys create`` and ``keys rotate`` print the new secret,
which is shown only this once.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

URL_ENV = "PORTICO_URL"
ADMIN_KEY_ENV = "PORTICO_ADMIN_KEY"
DEFAULT_URL = "http://127.0.0.1:8000"

_LIMIT_FLAGS = {
    "requests_per_minute": "--rpm",
    "tokens_per_minute": "--tpm",
    "max_concurrency": "--max-concurrency",
    "monthly_token_budget": "--monthly-token-budget",
    "max_tokens_default": "--max-tokens-default",
}


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    for field, flag in _LIMIT_FLAGS.items():
        p.add_argument(
            flag, dest=field, type=int, metavar="N", help=f"override {field.replace('_', ' ')}"
        )
    p.add_argument(
        "--budget-usd",
        dest="budget_usd",
        type=float,
        metavar="USD",
        help="money budget in US dollars per --budget-period, at the models' prices "
        "(0 admits nothing)",
    )
    p.add_argument(
        "--budget-period",
        dest="budget_period",
        choices=("daily", "monthly"),
        help="the money budget's period, UTC (default monthly)",
    )


def _add_price_commands(sub: Any) -> None:
    prices = sub.add_parser("prices", help="list, show, set, delete per-model prices")
    psub = prices.add_subparsers(dest="prices_command", metavar="ACTION", required=True)
    psub.add_parser("list", help="every priced model and where its price comes from")
    p = psub.add_parser("show", help="one model's price")
    p.add_argument("model")
    p = psub.add_parser(
        "set", help="set a model's price (US dollars per 1M tokens); overrides the config's"
    )
    p.add_argument("model")
    p.add_argument("--input", type=float, required=True, metavar="USD", help="per 1M prompt tokens")
    p.add_argument(
        "--cached-input",
        dest="cached_input",
        type=float,
        default=None,
        metavar="USD",
        help="per 1M prompt tokens read from the prefix cache (default: --input)",
    )
    p.add_argument(
        "--output", type=float, required=True, metavar="USD", help="per 1M output tokens"
    )
    p = psub.add_parser("delete", help="delete the admin price (the config's applies again)")
    p.add_argument("model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=None, help=f"gateway base URL (default ${URL_ENV} or {DEFAULT_URL})"
    )
    parser.add_argument(
        "--admin-key",
        default=None,
        help=f"admin key (default ${ADMIN_KEY_ENV}, else the file {_default_key_file()} that "
        "`portico serve` writes here; prefer --admin-key-file)",
    )
    parser.add_argument(
        "--admin-key-file", type=Path, default=None, help="file holding the admin key"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument(
        "--ca-file",
        type=Path,
        default=None,
        help="CA bundle that signed the gateway's TLS certificate (https URLs)",
    )
    parser.add_argument(
        "--client-cert",
        type=Path,
        default=None,
        help="client certificate (PEM) when the admin API requires one",
    )
    parser.add_argument(
        "--client-key",
        type=Path,
        default=None,
        help="private key (PEM) of --client-cert, if not in the same file",
    )
    sub = parser.add_subparsers(dest="keys_command", metavar="COMMAND", required=True)
    _add_tenant_commands(sub)
    _add_key_commands(sub)
    sub.add_parser("plans", help="list the plans")
    _add_price_commands(sub)


def _add_tenant_commands(sub: Any) -> None:
    """``portico keys tenants create|list|show|update|delete``."""
    tenants = sub.add_parser("tenants", help="create, list, show, update, delete tenants")
    tsub = tenants.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)
    p = tsub.add_parser("create", help="create a tenant")
    p.add_argument("tenant_id")
    p.add_argument("--name", default=None, help="display name (default: the id)")
    p.add_argument("--plan", default=None, help="plan name (default: the default plan)")
    p.add_argument(
        "--allowed-model",
        dest="allowed_models",
        action="append",
        default=None,
        help="a model the tenant may use (repeat); default: the plan's list",
    )
    p.add_argument("--share-prefix-cache", action="store_true", default=None)
    _add_limit_flags(p)
    tsub.add_parser("list", help="list tenants")
    p = tsub.add_parser("show", help="show one tenant")
    p.add_argument("tenant_id")
    p = tsub.add_parser("update", help="change plan, name, models, limits, disabled flag")
    p.add_argument("tenant_id")
    p.add_argument("--name", default=None)
    p.add_argument("--plan", default=None)
    p.add_argument("--allowed-model", dest="allowed_models", action="append", default=None)
    state = p.add_mutually_exclusive_group()
    state.add_argument("--disable", dest="disabled", action="store_const", const=True)
    state.add_argument("--enable", dest="disabled", action="store_const", const=False)
    _add_limit_flags(p)
    p = tsub.add_parser("delete", help="delete a tenant and all its keys")
    p.add_argument("tenant_id")


def _add_key_commands(sub: Any) -> None:
    """``portico keys create|list|revoke|rotate|usage``: a tenant's API keys and usage."""
    p = sub.add_parser("create", help="create an API key (the secret is printed once)")
    p.add_argument("tenant_id")
    p.add_argument("--name", default=None)
    p.add_argument(
        "--expires-in", dest="expires_in_seconds", type=int, default=None, metavar="SECONDS"
    )
    p.add_argument("--scope", dest="scopes", action="append", default=None)
    _add_limit_flags(p)  # the key's own limits, beside its tenant's
    p = sub.add_parser("list", help="list a tenant's keys")
    p.add_argument("tenant_id")
    p = sub.add_parser("revoke", help="revoke a key now")
    p.add_argument("tenant_id")
    p.add_argument("key_id")
    p = sub.add_parser(
        "rotate", help="new secret for a key; the old one stops working now, or after --grace"
    )
    p.add_argument("tenant_id")
    p.add_argument("key_id")
    p.add_argument(
        "--grace",
        dest="grace_seconds",
        type=int,
        default=0,
        metavar="SECONDS",
        help="keep the old secret working this long (default 0: it stops working now)",
    )
    p = sub.add_parser("usage", help="a tenant's usage per day and model")
    p.add_argument("tenant_id")
    p.add_argument("--start", default=None, help="YYYY-MM-DD (default: 29 days before end)")
    p.add_argument("--end", default=None, help="YYYY-MM-DD (default: today, UTC)")


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    names = [*_LIMIT_FLAGS, "budget_usd", "budget_period"]
    return {f: getattr(args, f) for f in names if getattr(args, f, None) is not None}


def _price_request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    action = args.prices_command
    if action == "list":
        return "GET", "/admin/v1/prices", None
    path = f"/admin/v1/prices/{_seg(args.model)}"
    if action == "set":
        body = {"input": args.input, "output": args.output}
        if args.cached_input is not None:
            body["cached_input"] = args.cached_input
        return "PUT", path, body
    return ("DELETE" if action == "delete" else "GET"), path, None


def _seg(value: str) -> str:
    """One URL path segment: an id can never climb to another admin route."""
    return quote(value, safe="")


def _request(
    args: argparse.Namespace,
) -> tuple[str, str, dict[str, Any] | None, dict[str, str] | None]:
    """(method, path, JSON body, query) for the parsed command."""
    cmd = args.keys_command
    if cmd == "tenants":
        action = args.tenants_command
        if action == "list":
            return "GET", "/admin/v1/tenants", None, None
        if action == "show":
            return "GET", f"/admin/v1/tenants/{_seg(args.tenant_id)}", None, None
        if action == "delete":
            return "DELETE", f"/admin/v1/tenants/{_seg(args.tenant_id)}", None, None
        body: dict[str, Any] = {}
        for field in ("name", "plan", "allowed_models", "share_prefix_cache", "disabled"):
            if getattr(args, field, None) is not None:
                body[field] = getattr(args, field)
        if _limits(args):
            body["overrides"] = _limits(args)
        if action == "create":
            body = {"id": args.tenant_id, "name": args.name or args.tenant_id, **body}
            return "POST", "/admin/v1/tenants", body, None
        return "PATCH", f"/admin/v1/tenants/{_seg(args.tenant_id)}", body, None
    if cmd == "prices":
        return (*_price_request(args), None)
    base = f"/admin/v1/tenants/{_seg(getattr(args, 'tenant_id', ''))}"
    if cmd == "create":
        body = {
            k: getattr(args, k)
            for k in ("name", "expires_in_seconds", "scopes")
            if getattr(args, k) is not None
        }
        if _limits(args):
            body["limits"] = _limits(args)
        return "POST", f"{base}/keys", body, None
    if cmd == "list":
        return "GET", f"{base}/keys", None, None
    if cmd == "revoke":
        return "POST", f"{base}/keys/{_seg(args.key_id)}/revoke", None, None
    if cmd == "rotate":
        grace = {"grace_seconds": args.grace_seconds}
        return "POST", f"{base}/keys/{_seg(args.key_id)}/rotate", grace, None
    if cmd == "usage":
        query = {k: getattr(args, k) for k in ("start", "end") if getattr(args, k)}
        return "GET", f"{base}/usage", None, query
    return "GET", "/admin/v1/plans", None, None


def _default_key_file() -> Path:
    """Where ``portico serve`` writes the admin key it generates (its default data dir)."""
    from gateway.cli import ADMIN_KEY_FILENAME
    from gateway.store import StoreSettings

    return StoreSettings().data_dir / ADMIN_KEY_FILENAME


def _admin_key(args: argparse.Namespace) -> str | None:
    key: str | None
    if args.admin_key_file is not None:
        key = args.admin_key_file.read_text().strip()
        return key
    key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    if key:
        return key
    generated = _default_key_file()
    return generated.read_text().strip() or None if generated.is_file() else None


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(args.ca_file) if args.ca_file else None)
    if args.client_cert is not None:
        ctx.load_cert_chain(
            str(args.client_cert), str(args.client_key) if args.client_key else None
        )
    return ctx


def run(args: argparse.Namespace) -> int:
    import httpx

    try:
        key = _admin_key(args)
    except OSError as exc:
        print(f"error: cannot read the admin key file: {exc.strerror}", file=sys.stderr)
        return 2
    if not key:
        print(
            f"error: no admin key: pass --admin-key-file or set ${ADMIN_KEY_ENV} "
            f"(or run from the folder where `portico serve` wrote {_default_key_file()})",
            file=sys.stderr,
        )
        return 2
    url = (args.url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
    method, path, body, query = _request(args)
    try:
        tls = _tls_context(args)
    except (OSError, ssl.SSLError) as exc:
        print(f"error: cannot load the TLS files: {exc}", file=sys.stderr)
        return 2
    try:
        with httpx.Client(base_url=url, timeout=args.timeout, verify=tls) as client:
            resp = client.request(
                method, path, json=body, params=query, headers={"Authorization": f"Bearer {key}"}
            )
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        print(f"error ({resp.status_code}): {message}", file=sys.stderr)
        return 1
    if resp.status_code != 204:
        print(json.dumps(resp.json(), indent=2, sort_keys=True))
    if args.keys_command in ("create", "rotate"):
        print("Store this key now: it will not be shown again.", file=sys.stderr)
    return 0
