"""The n-gram proposer (prompt lookup): the context's own past proposes its future.

If the last ``n`` tokens of a request (``prompt_lookup_max`` down to ``prompt_lookup_min``)
occurred earlier in its prompt or output, the tokens that followed that earlier occurrence are
the guess. Costs a vectorized scan of the context and no model call, which is why it pays on
work that repeats the prompt (editing code, quoting a passage, extracting fields).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.request import Request


class NgramProposer:
    """Proposes up to ``k`` tokens per request from its longest repeated suffix. Stateless."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose_one(self, token_ids: Sequence[int], k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``token_ids`` (``max_n`` down to ``min_n`` tokens long); [] when none occurred."""
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # Windows that start early enough to have a continuation (exclude the suffix itself).
            windows = sliding_window_view(tokens[: num_tokens - 1], n)
            hits = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
            if hits.size:
                # The latest occurrence (closest to what is written now), copied the way LZ77
                # copies: a continuation that runs into the present repeats with the same
                # period, so a loop proposes k more turns of itself.
                start = int(hits[-1]) + n
                guess = tokens[start : start + k].tolist()
                while len(guess) < k:
                    guess.append(guess[start + len(guess) - num_tokens])
                return guess
        return []

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [
            self.propose_one(req.all_token_ids, k)
            for req, k in zip(requests, num_tokens, strict=True)
        ]

    def forget(self, request_id: str) -> None:
        """Nothing kept per request."""
