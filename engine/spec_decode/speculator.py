"""The engine's side of speculative decoding: who guesses this step, how many, and the counts.

Each step, before scheduling, :meth:`Speculator.propose` asks the proposer for guesses for the
running requests that are decoding (``request.spec_token_ids``); the scheduler gives them KV
slots if they fit, the runner feeds them, :meth:`engine.sampler.Sampler.verify` keeps those
the target agrees with, and :meth:`record` counts the outcome. The off switch: with more
running requests than ``disable_by_batch_size`` nobody speculates, because a large batch is
compute-bound and verifying guesses would cost more than the accepted tokens save.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    """Guesses the next tokens of requests. Guesses are point masses (no probabilities)."""

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Up to ``num_tokens[i]`` guessed tokens following ``requests[i].all_token_ids``."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what the proposer keeps for a request (a draft model's KV blocks)."""
        ...


@dataclass
class SpecDecodeStats:
    """Cumulative counts (vLLM's spec_decode metrics). ``num_accepted_tokens_per_pos[j]``:
    drafts whose guess ``j`` was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class Speculator:
    """Runs a proposer for the decoding requests of a step and keeps the acceptance counts.

    A request speculates when it is decoding and has room for at least one more token after
    the one it samples anyway (``max_tokens``, the context limit). A request with a grammar
    speculates too: the grammar masks each verified position (see
    ``StructuredOutputManager.fill_bitmask_for_guesses``). Not thread-safe: the engine thread
    only.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens
        )

    def is_enabled(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` of every running request (empty when it does not guess)."""
        if not self.is_enabled(len(running)):
            for req in running:
                req.spec_token_ids = []
            return
        chosen: list[Request] = []
        budgets: list[int] = []
        for req in running:
            req.spec_token_ids = []
            num = self._num_to_propose(req)
            if num > 0:
                chosen.append(req)
                budgets.append(num)
        if chosen:
            for req, guess in zip(chosen, self.proposer.propose(chosen, budgets), strict=True):
                req.spec_token_ids = guess

    def _num_to_propose(self, req: Request) -> int:
        if req.num_tokens - req.num_computed_tokens != 1:
            return 0
        num = min(self.config.num_speculative_tokens, self.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:  # the step samples one token anyway; guesses add to it
            num = min(num, max_tokens - req.num_output_tokens - 1)
        return num

    def record(self, guesses: Sequence[Sequence[int]], num_accepted: Sequence[int]) -> None:
        """Count one step's verification (requests that verified no guess are skipped)."""
        per_pos = self.stats.num_accepted_tokens_per_pos
        for guess, accepted in zip(guesses, num_accepted, strict=True):
            if not guess:
                continue
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += len(guess)
            self.stats.num_accepted_tokens += accepted
            for j in range(accepted):
                per_pos[j] += 1

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
