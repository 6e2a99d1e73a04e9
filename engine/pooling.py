"""Reading the prompt's hidden states: embeddings (pooling) and prompt logprobs.

An embedding request and a request with ``prompt_logprobs`` run through the scheduler like any
other request: their prompt is prefilled in the same flattened batches as everyone's decodes
and prefill chunks (chunked prefill, the shared token budget). The runner hands each step's
final hidden states to a :class:`PromptTap`, which keeps, per such request, only what it needs:

* pooling: a running sum (``MEAN``), the first row (``CLS``) or the last prompt row (``LAST``),
  finished into one vector (optionally L2-normalised, optionally cut to ``dimensions``), or, for
  a cross-encoder's pair (``score_head``), the score head's logits of the pooled row;
* prompt logprobs: the log-softmax of the logits at prompt position ``p`` read at token
  ``p + 1``, with the top alternatives.

The hidden states are the model's final (normed) ones, as vLLM's poolers and transformers'
``last_hidden_state`` are. Such a request must see every prompt position computed, so the
engine gives it a salt of its own: the prefix cache cannot skip any of its positions. A
recompute preemption runs the prompt again; positions already read are not read twice.
Engine thread only; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.outputs import TokenLogprob
from engine.pooling_params import PoolingParams

if TYPE_CHECKING:
    from engine.request import Request

PROMPT_LOGPROB_ROWS = 256  # logits computed per slice: bounds the [rows, vocab] temporary


def pool(rows_sum: torch.Tensor, params: PoolingParams, count: int) -> list[float]:
    """Finish a pooled vector: mean (sum / count), Matryoshka cut, L2 normalisation."""
    vector = rows_sum.float() / count if params.pooling_type == "MEAN" else rows_sum.float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
    return [float(x) for x in vector.tolist()]


@dataclass
class _PromptState:
    """What the tap keeps for one request while its prompt is read."""

    num_prompt_tokens: int
    pooling: PoolingParams | None
    num_prompt_logprobs: int | None
    next_position: int = 0  # prompt positions before this one were read already
    pooled: torch.Tensor | None = None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)


class PromptTap:
    """Reads the prompt rows of the requests registered with it out of each step's hidden
    states (see the module docstring). ``compute_logits`` is the model's LM head;
    ``compute_scores`` its score head (a cross-encoder's; None for a causal LM)."""

    def __init__(
        self,
        compute_logits: Any,
        compute_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.compute_logits = compute_logits
        self.compute_scores = compute_scores
        self._states: dict[str, _PromptState] = {}

    def __bool__(self) -> bool:
        return bool(self._states)

    def register(
        self,
        request_id: str,
        num_prompt_tokens: int,
        pooling: PoolingParams | None,
        num_prompt_logprobs: int | None,
    ) -> None:
        self._states[request_id] = _PromptState(num_prompt_tokens, pooling, num_prompt_logprobs)

    def pop_if_read(self, request_id: str, finished: bool) -> _PromptState | None:
        """The request's state once its whole prompt was read (or it finished: then it is
        forgotten either way), else None."""
        state = self._states.get(request_id)
        if state is None or not (finished or state.next_position >= state.num_prompt_tokens):
            return None
        del self._states[request_id]
        return state

    def read(self, scheduled: list[tuple[Request, int]], hidden: torch.Tensor) -> None:
        """Take what the registered requests need from ``hidden`` ([tokens, hidden_size],
        rows in the order of ``scheduled``); call before the requests' counters advance."""
        offset = 0
        for req, num_new in scheduled:
            state = self._states.get(req.request_id)
            if state is not None:
                start = req.num_computed_tokens
                lo = max(start, state.next_position)
                hi = min(start + num_new, state.num_prompt_tokens)
                if lo < hi:
                    rows = hidden[offset + lo - start : offset + hi - start]
                    self._read_rows(req, state, rows, lo, hi)
                    state.next_position = hi
            offset += num_new

    def _read_rows(
        self, req: Request, state: _PromptState, rows: torch.Tensor, lo: int, hi: int
    ) -> None:
        params = state.pooling
        if params is not None:
            if params.pooling_type == "MEAN":
                part = rows.float().sum(dim=0)
                state.pooled = part if state.pooled is None else state.pooled + part
            elif params.pooling_type == "CLS" and lo == 0:
                state.pooled = rows[0].float().clone()
            elif params.pooling_type == "LAST" and hi == state.num_prompt_tokens:
                state.pooled = rows[-1].float().clone()
        if state.num_prompt_logprobs is not None:
            if lo == 0:
                state.prompt_logprobs.append(None)  # nothing predicts the first token
            self._read_logprobs(req, state, rows, lo, hi)

    def _read_logprobs(
        self, req: Request, state: _PromptState, rows: torch.Tensor, lo: int, hi: int
    ) -> None:
        # Row p predicts prompt token p + 1; the last prompt row predicts the first output.
        last = min(hi, state.num_prompt_tokens - 1)
        if lo >= last:
            return
        k = state.num_prompt_logprobs or 0
        targets = torch.tensor(req.prompt_token_ids[lo + 1 : last + 1], device=rows.device)
        for s in range(0, last - lo, PROMPT_LOGPROB_ROWS):
            logits = self.compute_logits(rows[s : min(s + PROMPT_LOGPROB_ROWS, last - lo)])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            chosen = logprobs.gather(1, targets[s : s + len(logprobs)].unsqueeze(1)).squeeze(1)
            top_values, top_ids = (
                logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
            )
            for i, (token, value) in enumerate(
                zip(targets[s : s + len(logprobs)].tolist(), chosen.tolist(), strict=True)
            ):
                top = list(zip(top_ids[i].tolist(), top_values[i].tolist(), strict=True))
                state.prompt_logprobs.append(TokenLogprob(token, value, top))

    def result(self, state: _PromptState) -> list[float] | None:
        """The pooled vector of a request whose prompt was read whole (None without pooling)."""
        if state.pooling is None or state.pooled is None:
            return None
        if state.pooling.score_head:
            if self.compute_scores is None:
                raise ValueError("a score-head request on a model without a score head")
            with torch.no_grad():
                return [float(x) for x in self.compute_scores(state.pooled).tolist()]
        return pool(state.pooled, state.pooling, state.num_prompt_tokens)
