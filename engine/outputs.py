"""What the engine hands back to its callers: one :class:`RequestOutput` per request per step.

These are plain dataclasses with no behaviour, so the server, the offline API and the tests
can read them without importing anything heavy. Times are ``time.monotonic()`` seconds except
``arrival_time`` which uses the same clock (the engine stamps it with ``time.monotonic()`` unless
the caller passes one).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The log-probability of one sampled token and its top alternatives.

    ``logprob`` and ``top_logprobs`` come from the log-softmax of the *processed* distribution
    (after penalties, logit_bias and temperature, before the top-k/top-p/min-p masks), which is
    what vLLM reports by default. For greedy rows the temperature is taken as 1.
    ``top_logprobs`` is ordered best first and holds ``params.logprobs`` entries
    (``(token_id, logprob)``); it may include the chosen token.
    """

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """Per-request timings, all ``time.monotonic()`` seconds (None until they happen).

    The server derives TTFT (``first_token_time - arrival_time``), inter-token latency and
    end-to-end latency (``finished_time - arrival_time``) from these. The ``*_step`` fields
    count the engine's steps (``num_steps``): the count when the request entered the engine,
    the step that first scheduled it and the step that produced its first token, so a trace
    says how many steps a request waited and how many its prefill took. ``inflight_step_*``:
    the step that was running when the request arrived (None if the engine was between
    steps), so its wait for that step can be told from the rest.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    added_step: int | None = None
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    inflight_step_start: float | None = None
    inflight_step_end: float | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request, cumulative plus the delta of this step.

    ``text``/``token_ids`` are everything produced so far; ``text_delta``/``token_ids_delta``
    are what this step added (what a streaming server sends). ``finish_reason`` is ``None``
    while running, else ``"stop"`` (EOS, stop token or stop string), ``"length"`` (max_tokens
    or the context limit) or ``"abort"``. ``stop_reason`` is the stop string or stop token id
    that ended it (``None`` for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    text_delta: str
    token_ids_delta: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step: its completions and whether all have finished.

    ``num_cached_tokens`` is how many prompt tokens were served from the prefix cache (the
    maximum over the ``n`` children).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # Read from the prompt's hidden states (engine/pooling.py), on the first output after the
    # prompt was computed: the pooled vector of an embedding request; with prompt_logprobs,
    # one entry per prompt token (None for the first: nothing predicts it).
    embedding: list[float] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
