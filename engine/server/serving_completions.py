"""``POST /v1/completions``: one engine request per prompt (string, strings, or token ids)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput, TokenLogprob
from engine.server import sse
from engine.server.engine_requests import EngineStreamingResponse, merge, unless_disconnected
from engine.server.protocol import CompletionRequest
from engine.server.serving_engine import (
    OpenAIServing,
    delta_logprobs,
    random_id,
    usage,
)
from portico.errors import InvalidRequestError


@dataclass
class Prompt:
    """One prompt of a completions request: its token ids and (for ``echo``) its text."""

    token_ids: list[int]
    text: str


class CompletionServing:
    """Answers text completions for one model, streaming or not, in OpenAI's exact shapes."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def prompts(self, req: CompletionRequest) -> list[Prompt]:
        tokenizer = self.serving.tokenizer
        items: list[str | list[int]]
        if isinstance(req.prompt, str):
            items = [req.prompt]
        elif req.prompt and isinstance(req.prompt[0], int):
            items = [cast(list[int], req.prompt)]  # one prompt of token ids
        else:
            items = list(cast(list[str | list[int]], req.prompt))
        prompts = []
        for index, item in enumerate(items):
            if isinstance(item, str):
                ids = list(tokenizer.encode(item, add_special_tokens=True))
                if not ids:
                    raise InvalidRequestError("The prompt must not be empty.", param="prompt")
                prompts.append(Prompt(ids, item))
            else:
                self.serving.check_token_ids(item, f"prompt[{index}]")
                text = str(tokenizer.decode(item)) if req.echo else ""
                prompts.append(Prompt(list(item), text))
        return prompts

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        serving = self.serving
        serving.check_request(req)
        if req.echo and req.logprobs is not None:
            raise InvalidRequestError(
                "echo together with logprobs (prompt logprobs) is not supported by this "
                "engine yet.",
                param="echo",
                code="unsupported_parameter",
            )
        prompts = self.prompts(req)
        jobs = []
        for prompt in prompts:
            max_tokens = serving.max_tokens_for(
                req.requested_max_tokens, len(prompt.token_ids), "prompt"
            )
            jobs.append((prompt.token_ids, serving.sampling_params(req, max_tokens)))
        request_id = random_id("cmpl")
        submitted = serving.submit_all(jobs, req, request_id)
        outputs = merge(submitted)
        if req.stream:
            return EngineStreamingResponse(
                self.stream(req, request_id, prompts, outputs), submitted
            )
        body = await unless_disconnected(self.collect(req, request_id, prompts, outputs), request)
        return JSONResponse(body)

    async def collect(
        self,
        req: CompletionRequest,
        request_id: str,
        prompts: list[Prompt],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> dict[str, Any]:
        texts: dict[int, str] = {}
        finish: dict[int, tuple[str | None, int | str | None]] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        num_tokens: dict[int, int] = {}
        num_cached: dict[int, int] = {}
        async for prompt_index, out in outputs:
            num_cached[prompt_index] = out.num_cached_tokens
            for c in out.outputs:
                index = prompt_index * req.n + c.index
                texts[index] = c.text
                num_tokens[index] = len(c.token_ids)
                finish[index] = (c.finish_reason, c.stop_reason)
                logprobs.setdefault(index, []).extend(delta_logprobs(c))
        choices = []
        for index in sorted(texts):
            prefix = prompts[index // req.n].text if req.echo else ""
            choices.append(
                {
                    "index": index,
                    "text": prefix + texts[index],
                    "logprobs": (
                        self.logprobs(logprobs[index], len(prefix))
                        if req.logprobs is not None
                        else None
                    ),
                    "finish_reason": finish[index][0],
                    "stop_reason": finish[index][1],
                }
            )
        return {
            "id": request_id,
            "object": "text_completion",
            "created": self.serving.created(),
            "model": self.serving.model_name,
            "choices": choices,
            "usage": usage(
                sum(len(p.token_ids) for p in prompts),
                sum(num_tokens.values()),
                sum(num_cached.values()),
            ),
        }

    async def stream(
        self,
        req: CompletionRequest,
        request_id: str,
        prompts: list[Prompt],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[bytes]:
        created = self.serving.created()
        include_usage = req.include_usage

        num_tokens: dict[int, int] = {}
        num_cached: dict[int, int] = {}

        def usage_so_far() -> dict[str, Any]:
            return usage(
                sum(len(p.token_ids) for p in prompts),
                sum(num_tokens.values()),
                sum(num_cached.values()),
            )

        chunk = sse.chunk_writer(
            request_id,
            "text_completion",
            created,
            self.serving.model_name,
            include_usage,
            usage_so_far if req.continuous_usage else None,
        )

        def choice(
            index: int, text: str, finish: str | None = None, logprobs: Any = None
        ) -> dict[str, Any]:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        if req.echo:
            for index in range(len(prompts) * req.n):
                yield chunk([choice(index, prompts[index // req.n].text)])
        offsets: dict[int, int] = {}
        try:
            async for prompt_index, out in outputs:
                num_cached[prompt_index] = out.num_cached_tokens
                for c in out.outputs:
                    index = prompt_index * req.n + c.index
                    num_tokens[index] = len(c.token_ids)
                    if c.text_delta or (req.logprobs is not None and c.token_ids_delta):
                        logprobs = None
                        if req.logprobs is not None:
                            logprobs = self.logprobs(delta_logprobs(c), offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + len(c.text_delta)
                        yield chunk([choice(index, c.text_delta, logprobs=logprobs)])
                    if c.finish_reason is not None:
                        yield chunk([choice(index, "", c.finish_reason)])
        except Exception as exc:
            yield sse.error_event(exc)
            yield sse.DONE
            return
        if include_usage:
            yield chunk([], usage=usage_so_far())
        yield sse.DONE

    def logprobs(self, entries: list[TokenLogprob], start_offset: int) -> dict[str, Any]:
        """OpenAI's legacy completions ``logprobs`` object for these tokens."""
        serving = self.serving
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = start_offset
        for entry in entries:
            text = serving.token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(serving.logprob_value(entry.logprob))
            top.append(
                {
                    serving.token_text(tid): serving.logprob_value(lp)
                    for tid, lp in entry.top_logprobs
                }
            )
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }
