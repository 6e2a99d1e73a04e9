"""What chat and completions share: the model check, prompt limits, sampling parameters, and
submitting engine requests with error mapping.

:class:`OpenAIServing` turns an already-validated request into engine calls. It raises
:class:`~portico.errors.APIError` subclasses only; the app maps those to HTTP.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.lora import LoRARequest
from engine.lora.manager import LoRAManager
from engine.multimodal import ImageInput
from engine.outputs import CompletionOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.server.engine_requests import EngineRequest
from engine.server.metrics import ServerMetrics
from engine.server.protocol_chat import ChatCompletionRequest
from engine.server.protocol_completions import CompletionRequest
from engine.server.structured_fields import structured_outputs_for
from engine.tenancy import TenantTag, tenant_from_headers
from portico.contract import tokenizer_fingerprint
from portico.errors import (
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
)

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM reports this floor too


class SubmittedFields(Protocol):
    """What :meth:`OpenAIServing.submit` reads from any request body."""

    @property
    def model(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...


def effective_max_model_len(engine: AsyncLLMEngine) -> int:
    """The context length requests are checked against: the user's cap or the model's."""
    model_len = int(engine.model_config.max_position_embeddings)
    cap = getattr(engine.config, "max_model_len", None)
    return min(model_len, cap) if cap else model_len


def tenant_of(headers: Mapping[str, str]) -> TenantTag:
    """The request's tenant from the gateway's engine-hop headers (engine/tenancy.py).

    A bad value is a 400 naming the header: only the gateway sets these, so one is a bug there
    (or a caller that bypasses it) and should be loud rather than silently defaulted.
    """
    try:
        return tenant_from_headers(headers)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param=getattr(exc, "param", None)) from None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    """Shared machinery of the OpenAI endpoints for one served model."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        # the gateway carries prompt ids only under this (portico/contract.py)
        self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.max_model_len = effective_max_model_len(engine)
        self.vocab_size = int(engine.model_config.vocab_size)  # rows of the embedding
        self._token_text: dict[int, str] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.lora: LoRAManager | None = getattr(engine.engine, "lora", None)

    # ------------------------------------------------------------------ validation

    def check_request(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        """Checks that span fields (the model's own checks were done by pydantic)."""
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise InvalidRequestError(
                "stream_options can only be given when stream is true.", param="stream_options"
            )

    def check_model(self, name: str) -> LoRARequest | None:
        """The adapter ``name`` names (None: the base model), or 404 for an unknown model."""
        if name == self.model_name:
            return None
        lora = self.lora.get(name) if self.lora is not None else None
        if lora is None:
            raise NotFoundError(
                f"The model '{name}' does not exist. This server serves '{self.model_name}'.",
                param="model",
            )
        return lora

    def check_token_ids(self, ids: list[int], param: str) -> None:
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"Token id {token} is out of range: the vocabulary has {self.vocab_size} "
                    "tokens.",
                    param=param,
                )

    def max_tokens_for(self, requested: int | None, num_prompt_tokens: int, what: str) -> int:
        """Tokens the completion may use, or a 400 saying what was asked and what fits."""
        limit = self.max_model_len
        if requested is None:
            if num_prompt_tokens >= limit:
                raise InvalidRequestError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"{what} has {num_prompt_tokens} tokens, which leaves no room for a "
                    "completion. Please reduce the length of the input.",
                    param="messages" if what == "messages" else "prompt",
                    code="context_length_exceeded",
                )
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                f"{what}, {requested} in the completion). Please reduce the length of the "
                f"{what} or completion.",
                param=(
                    "max_tokens"
                    if num_prompt_tokens < limit
                    else "messages"
                    if what == "messages"
                    else "prompt"
                ),
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        max_tokens: int,
    ) -> SamplingParams:
        logit_bias: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias"
                )
            logit_bias[int(key)] = value
        self.check_token_ids(list(logit_bias), "logit_bias")
        self.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        structured = structured_outputs_for(req)
        if structured is not None:  # validated here so the 400 names the field the user wrote
            try:
                self.engine.engine.structured.check(*structured)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param=structured[1]) from None
        try:
            return SamplingParams(
                n=req.n,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=req.min_p or 0.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if req.repetition_penalty is None else req.repetition_penalty
                ),
                seed=req.seed,
                stop=[req.stop] if isinstance(req.stop, str) else req.stop or [],
                stop_token_ids=req.stop_token_ids or [],
                ignore_eos=req.ignore_eos,
                logprobs=req.num_logprobs,
                prompt_logprobs=getattr(req, "num_prompt_logprobs", None),
                logit_bias=logit_bias,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=None if structured is None else structured[0],
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param=getattr(exc, "param", None)) from None

    # ------------------------------------------------------------------ generation

    async def compile_constraints(
        self,
        prompts: list[tuple[list[int], SamplingParams]],
        param: str,
        tenant: TenantTag | None = None,
    ) -> None:
        """Wait until the grammars of ``prompts`` are compiled (in the engine's compile pool,
        as ``tenant``'s compiles, then cached), so that a constraint the grammar library
        refuses, or whose compile runs past its budget, is a 400 naming ``param`` before
        anything is queued or sent. The event loop is never blocked meanwhile."""
        specs = {p.structured_outputs.cache_key: p.structured_outputs for _, p in prompts
                 if p.structured_outputs is not None}  # fmt: skip
        name = "default" if tenant is None else tenant.name
        structured = self.engine.engine.structured
        for spec in specs.values():
            try:
                structured.check(spec, param)  # the limits first (a tool's schema is new here)
                await structured.prepare(spec, param, name)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param=getattr(exc, "param", param)) from None

    def submit_all(
        self,
        prompts: list[tuple[list[int], SamplingParams]],
        req: SubmittedFields,
        request_id: str,
        tenant: TenantTag | None = None,
        mm_inputs: Sequence[ImageInput] = (),
    ) -> list[EngineRequest]:
        """Queue one engine request per prompt, all or none (a refusal aborts the others);
        ``mm_inputs``: the images of the (one) prompt."""
        submitted: list[EngineRequest] = []
        try:
            for index, (ids, params) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                submitted.append(self.submit(rid, ids, params, req, tenant, mm_inputs))
        except BaseException:
            for engine_request in submitted:
                engine_request.close()
            raise
        return submitted

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        req: SubmittedFields,
        tenant: TenantTag | None = None,
        mm_inputs: Sequence[ImageInput] = (),
    ) -> EngineRequest:
        """Queue one engine request now (so bad input fails before any response byte).

        ``tenant`` (from :func:`tenant_of`; None: the default tenant) is whom the engine's
        scheduler charges for it."""
        try:
            stream = self.engine.generate(
                request_id,
                prompt_token_ids,
                params,
                priority=req.priority,
                cache_salt=req.cache_salt,
                lora_request=self.check_model(req.model),
                tenant=tenant,
                mm_inputs=tuple(mm_inputs),
            )
        except EngineDeadError:
            raise ServiceUnavailableError("The engine is not running.") from None
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param=getattr(exc, "param", None)) from None
        return EngineRequest(
            self.engine,
            self.metrics,
            request_id,
            stream,
            len(prompt_token_ids),
            params.n,
            self._background,
        )

    # ------------------------------------------------------------------ helpers

    def token_text(self, token_id: int) -> str:
        cached = self._token_text.get(token_id)
        if cached is None:
            cached = str(self.tokenizer.decode([token_id]))
            self._token_text[token_id] = cached
        return cached

    @staticmethod
    def logprob_value(value: float) -> float:
        return max(value, LOGPROB_FLOOR)

    @staticmethod
    def created() -> int:
        return int(time.time())


def delta_logprobs(choice: CompletionOutput) -> list[TokenLogprob]:
    """The logprobs of the tokens this step added (whether the engine's list is cumulative or
    holds only the step's tokens)."""
    entries = choice.logprobs or []
    count = len(choice.token_ids_delta)
    if len(entries) == len(choice.token_ids) and len(entries) != count:
        return entries[len(entries) - count :]
    return entries


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }
