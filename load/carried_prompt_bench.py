"""What carrying a chat prompt's token ids from the gateway saves the engine (issue 44 item 3):
``python -m load.carried_prompt_bench [--model smollm2-135m] [--words 100]``.

Times, in this process's CPU time, the engine's own preparation of a plain chat prompt (the
messages rendered with the chat template and encoded: ``render_messages`` +
``apply_chat_template`` + ``encode``, as ``engine/server/serving_chat.py`` does) against what
it does with carried ids (``carried_prompt_ids`` and the vocabulary check), and what carrying
costs: the gateway writing the ids into the body (``with_prompt_ids``) and the engine parsing
them back.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from engine.server.protocol_chat import ChatMessage
from engine.server.tool_calling import NO_TOOLS, render_messages
from gateway.admission.prompt_tokens import load_tokenizer
from gateway.relay.carried_prompt import with_prompt_ids
from portico.contract import (
    PROMPT_IDS_HEADER,
    carried_prompt_ids,
    prompt_ids_field,
    tokenizer_fingerprint,
)


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    """Best of 3 runs of ``calls`` calls, in microseconds of CPU time per call."""
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--words", type=int, default=100, help="words in the user message")
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args(argv)
    tok = load_tokenizer(args.model)  # as the gateway loads it: the engine's own folder
    if tok is None:
        raise SystemExit(f"no tokenizer for {args.model}: run `portico models pull`")
    text = " ".join(f"word{i} by the river" for i in range(args.words // 4))
    messages = [
        ChatMessage.model_validate({"role": "system", "content": "You answer briefly."}),
        ChatMessage.model_validate({"role": "user", "content": text}),
    ]

    def render() -> list[int]:
        conversation, tools = render_messages(messages, NO_TOOLS, False)
        prompt = tok.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return list(tok.encode(prompt, add_special_tokens=False))

    ids = render()
    fingerprint = tokenizer_fingerprint(tok)
    headers = {PROMPT_IDS_HEADER: fingerprint}
    vocab = len(tok)

    def carried() -> list[int]:
        got = carried_prompt_ids(headers, ids, fingerprint)
        assert got is not None and all(0 <= t < vocab for t in got)
        return list(got)

    field = b"{" + prompt_ids_field(ids) + b"}"
    body = b'{"model":"m","messages":[]}'
    report = {
        "model": args.model,
        "prompt_tokens": len(ids),
        "engine_render_and_encode_us": per_call_us(render, args.calls),
        "engine_carried_ids_us": per_call_us(carried, args.calls),
        "gateway_write_ids_us": per_call_us(lambda: with_prompt_ids(body, ids), args.calls),
        "engine_parse_ids_us": per_call_us(lambda: json.loads(field), args.calls),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
