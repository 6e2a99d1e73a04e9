"""The engine loop's state of one user request (its ``n`` completions), and the
:class:`RequestOutput` built from it: what :class:`engine.llm_engine.LLMEngine` reports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from engine.pooling import PromptTap
from engine.request import Request


@dataclass
class Completion:
    """Engine-side state of one child request: its text and what was already reported."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


@dataclass
class Parent:
    """One user request: its ``n`` completions and its timings."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    metrics: RequestMetrics
    num_finished: int = 0
    touched: bool = field(default=False)
    # Children 1..n-1 wait here until child 0's prompt is computed, so that with prefix caching
    # they find the prompt's full blocks cached instead of each computing it again.
    pending: list[Completion] = field(default_factory=list)


def make_output(parent: Parent, prompt_tap: PromptTap) -> RequestOutput:
    """``parent``'s output now: full text and tokens, the deltas since the last output (which
    are marked sent), and its embedding or prompt logprobs once read."""
    parent.touched = False
    outputs = []
    for c in parent.completions:
        req = c.request
        finished = c.finish_reason is not None
        text = c.detokenizer.visible_text(finished)
        token_ids = list(req.output_token_ids)
        outputs.append(
            CompletionOutput(
                index=c.index,
                text=text,
                token_ids=token_ids,
                text_delta=text[c.num_sent_chars :],
                token_ids_delta=token_ids[c.num_sent_tokens :],
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
        c.num_sent_chars = len(text)
        c.num_sent_tokens = len(token_ids)
    metrics = parent.metrics
    metrics.first_scheduled_time = min(
        (c.request.first_scheduled_time for c in parent.completions
         if c.request.first_scheduled_time is not None),
        default=None,
    )  # fmt: skip
    metrics.num_preemptions = sum(c.request.num_preemptions for c in parent.completions)
    done = parent.num_finished == len(parent.completions)
    embedding = prompt_logprobs = None
    if prompt_tap:
        first = parent.completions[0].request
        read = prompt_tap.pop_if_read(first.request_id, done)
        if read is not None:
            embedding = prompt_tap.result(read)
            if read.num_prompt_logprobs is not None:
                prompt_logprobs = read.prompt_logprobs
    return RequestOutput(
        request_id=parent.request_id,
        prompt_token_ids=parent.prompt_token_ids,
        outputs=outputs,
        finished=done,
        num_cached_tokens=max(c.request.num_cached_tokens for c in parent.completions),
        metrics=dataclasses.replace(metrics),
        embedding=embedding,
        prompt_logprobs=prompt_logprobs,
    )
