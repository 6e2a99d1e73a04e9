"""The end of a stream that the tenant's token budget cut short.

Admission lowers a request's ``max_tokens`` to what the tenant's monthly token budget has left
(:class:`~gateway.admission.admission.Ticket` ``budget_stop``); the engine then stops by itself
the step the budget runs out and ends the choice with ``finish_reason: "length"``, as for any
cap. So that the client can tell this cap from its own, the relay puts one error event naming
the quota (OpenAI's ``insufficient_quota``) just before ``data: [DONE]``. The relay reads no
JSON for it: it looks for the finish marker in the bytes it already has.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.relay.proxy import Exchange
from gateway.relay.usage_relay import DONE_EVENT, _dumps
from portico.errors import error_body

# a chat or completions choice cut by its cap; a Responses stream's incomplete response
_CUT_MARKS = (b'"finish_reason":"length"', b'"reason":"max_output_tokens"')


class BudgetStop:
    """Watches one stream's blocks (whole SSE events) in order; once a choice was cut by its
    cap, the ``[DONE]`` event is preceded by the quota's error event. Not thread-safe."""

    def __init__(self, budget: str, max_tokens: int) -> None:
        # a money budget (admission.py names it daily_/monthly_budget_usd) or the token one
        daily, money = budget.startswith("daily_"), "budget_usd" in budget
        renews = "at 00:00 UTC" if daily else "at the start of next month (UTC)"
        message = (
            f"The {budget} is spent: the completion was stopped at {max_tokens} tokens, what "
            f"was left of it. It renews {renews}."
        )
        code = "budget_exceeded" if money else "insufficient_quota"
        payload = _dumps(error_body(message, "insufficient_quota", None, code))
        self.event = b"data: " + payload + b"\n\n"
        self.cut = False

    def feed(self, block: bytes) -> bytes:
        if not self.cut:
            self.cut = any(mark in block for mark in _CUT_MARKS)
        if self.cut and block.endswith(DONE_EVENT):
            self.cut = False  # one notice per stream
            return block[: -len(DONE_EVENT)] + self.event + DONE_EVENT
        return block

    async def relay(self, blocks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for block in blocks:
            yield self.feed(block)


def watch_budget(exchange: Exchange, budget: str, max_tokens: int) -> None:
    """Make a streamed ``exchange`` end with the quota's notice if its cap cut it."""
    stop = BudgetStop(budget, max_tokens)
    if exchange.first is not None:
        exchange.first = stop.feed(exchange.first)
    if exchange.rest is not None:
        exchange.rest = stop.relay(exchange.rest)
