"""What salting and exact accounting cost the gateway per request: the request path's pure
work before (the commit given, default the one before issue 30's token path) and now, in one
process, on the same inputs.

Per request the gateway now checks the client's ``cache_salt`` (parse), derives the engine's
salt and builds the engine body (``upstream_body``), reads usage from every chunk of a stream
(``continuous_usage_stats``) instead of only the last, and caps max_tokens at the token
budget's remainder at admission. Redis round trips are unchanged (same scripts, same count),
so they are left out: this is the CPU the changes add.

    python -m load.accounting_cost [--before 63f8328] [--chunks 64] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import timeit
import types
from pathlib import Path
from typing import Any

from gateway.body import fields as fields_now
from gateway.relay import usage_relay as proxy_now

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAT = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 8},
        {"role": "user", "content": "Tell me about the sea. " * 4},
    ],
    "max_tokens": 64,
}


WINGS = ("body", "relay", "fleet", "remotes", "batch")


def old_module(
    commit: str, path: str, name: str, also_then: dict[str, str] | None = None
) -> types.ModuleType:
    """``path`` as it was at ``commit``, imported under ``name`` (its imports are today's, but
    for ``also_then``: module name -> an old module already loaded by this function, for a
    module whose names today's no longer has)."""
    source = subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=REPO_ROOT, check=True, capture_output=True
    ).stdout.decode()
    for theirs, ours in (also_then or {}).items():
        source = source.replace(f"from {theirs} import", f"from {ours} import")
    for wing in WINGS:  # gateway/dataplane/ became wings (issue 44): today's module paths
        for file in (REPO_ROOT / "gateway" / wing).glob("*.py"):
            source = source.replace(
                f"gateway.dataplane.{file.stem} ", f"gateway.{wing}.{file.stem} "
            )
    module = types.ModuleType(name)
    module.__dict__["__name__"] = name
    sys.modules[name] = module
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


def engine_stream(chunks: int, continuous: bool) -> list[bytes]:
    """A chat stream as the engine writes it (compact JSON, one event per read): usage null
    on each chunk and once at the end, or (``continuous``) the usage so far on each."""
    events = []
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
    used: dict[str, Any] = {}
    for i in range(chunks + 1):
        finish = "length" if i == chunks else None
        choice = {"index": 0, "delta": {"content": " tok"}, "logprobs": None,
                  "finish_reason": finish}  # fmt: skip
        used = {"prompt_tokens": 60, "completion_tokens": i, "total_tokens": 60 + i,
                "prompt_tokens_details": {"cached_tokens": 48}}  # fmt: skip
        body = {**head, "choices": [choice], "usage": used if continuous else None}
        events.append(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")
    body = {**head, "choices": [], "usage": used}
    events.append(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def paired_us(then: Any, now: Any, number: int, repeat: int) -> tuple[float, float]:
    """Best CPU time per call of each (process time: a busy machine's other processes do not
    count), the two measured in turn (a load that drifts hits both alike)."""
    best_then = best_now = float("inf")
    for _ in range(repeat):
        best_then = min(best_then, timeit.Timer(then, timer=time.process_time).timeit(number))
        best_now = min(best_now, timeit.Timer(now, timer=time.process_time).timeit(number))
    return best_then / number * 1e6, best_now / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="63f8328", help="commit of the old request path")
    parser.add_argument("--chunks", type=int, default=64, help="tokens of the streamed answer")
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    fields_then = old_module(args.before, "gateway/dataplane/fields.py", "_fields_then")
    # the old proxy reads bodies with the old transport's read_body (gone with httpx's models)
    old_module(args.before, "gateway/dataplane/transport.py", "_transport_then")
    proxy_then = old_module(
        args.before, "gateway/dataplane/proxy.py", "_proxy_then",
        {"gateway.dataplane.transport": "_transport_then"},
    )  # fmt: skip
    n, r = args.number, args.repeat
    plain = json.dumps(CHAT).encode()
    salted = json.dumps({**CHAT, "cache_salt": "end-user-42"}).encode()
    streamed = json.dumps({**CHAT, "stream": True}).encode()
    old_events, new_events = engine_stream(args.chunks, False), engine_stream(args.chunks, True)

    def body_then(raw: bytes) -> None:
        f = fields_then.parse_fields(raw, "chat")
        proxy_then.upstream_body(raw, f, "tiny", "0123456789abcdef0123456789abcdef", None)

    def body_now(raw: bytes) -> None:
        f = fields_now.parse_fields(raw, "chat")
        proxy_now.upstream_body(raw, f, "tiny", "0123456789abcdef0123456789abcdef", None, True)

    def relay_then() -> None:
        usage = proxy_then.Usage()
        for event in old_events:
            proxy_then._take_usage(event, usage, False)

    def relay_now() -> None:
        usage = proxy_now.Usage()
        view = proxy_now.UsageView(continuous=True)
        for event in new_events:
            proxy_now._take_usage(event, usage, view)
        usage.resolve()  # when the stream ends

    rows = [
        ("parse + engine body, chat", lambda: body_then(plain), lambda: body_now(plain)),
        (
            "parse + engine body, client cache_salt",
            lambda: body_then(salted),
            lambda: body_now(salted),
        ),  # fmt: skip
        ("parse + engine body, stream", lambda: body_then(streamed), lambda: body_now(streamed)),
        (f"relay usage of a {args.chunks}-token stream", relay_then, relay_now),
    ]
    print(f"before: {args.before}; best of {r} x {n} calls; CPU microseconds per request")
    print("| step | before us | now us | added us |")
    print("|---|---|---|---|")
    for name, then, now in rows:
        a, b = paired_us(then, now, n, r)
        print(f"| {name} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
