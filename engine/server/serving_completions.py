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
from engine.server.protocol_completions import CompletionRequest
from engine.server.serving_engine import (
    OpenAIServing,
    delta_logprobs,
    random_id,
    tenant_of,
    usage,
)
from engine.server.shared_prefix import salt_with_prefix
from engine.server.structured_fields import structured_outputs_for
from portico.contract import PROMPT_IDS_FIELD, carried_prompt_ids, shared_prefix_of
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

    def prompts(self, req: CompletionRequest, carried: list[int] | None = None) -> list[Prompt]:
        """The request's prompts as token ids; ``carried``: a text prompt's ids as the gateway
        encoded them (portico/contract.py), used instead of encoding it here."""
        tokenizer = self.serving.tokenizer
        items: list[str | list[int]]
        if isinstance(req.prompt, str):
            items = [req.prompt]
        elif req.prompt and isinstance(req.prompt[0], int):
            items = [cast(list[int], req.prompt)]  # one prompt of token ids
        else:
            items = list(cast(list[str | list[int]], req.prompt))
        prompts = []
        keep = req.truncate_prompt_tokens
        for index, item in enumerate(items):
            if isinstance(item, str):
                if carried is not None and isinstance(req.prompt, str):  # one text prompt
                    self.serving.check_token_ids(carried, PROMPT_IDS_FIELD)
                    self.serving.metrics.carried("completions")
                    ids = list(carried)
                else:
                    ids = list(tokenizer.encode(item, add_special_tokens=True))
                if not ids:
                    raise InvalidRequestError("The prompt must not be empty.", param="prompt")
                if keep is not None and len(ids) > keep:  # vLLM's: keep the last N tokens
                    ids = ids[-keep:]
                    item = str(tokenizer.decode(ids)) if req.echo else item
                prompts.append(Prompt(ids, item))
            else:
                self.serving.check_token_ids(item, f"prompt[{index}]")
                ids = list(item)[-keep:] if keep is not None else list(item)
                text = str(tokenizer.decode(ids)) if req.echo else ""
                prompts.append(Prompt(ids, text))
        return prompts

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        serving = self.serving
        tenant = tenant_of(request.headers)
        serving.check_request(req)
        carried = carried_prompt_ids(
            request.headers, req.portico_prompt_token_ids, self.serving.tokenizer_fingerprint
        )
        prompts = self.prompts(req, carried)
        shared = shared_prefix_of(request.headers)
        if (
            shared is not None
            and isinstance(req.prompt, str)
            and req.truncate_prompt_tokens is None
        ):
            # the engine's salt for this request: the field's, widened over the shared prefix
            prefix = self.serving.tokenizer.encode(
                req.prompt[: shared.num_chars], add_special_tokens=True
            )
            req.cache_salt = salt_with_prefix(req.cache_salt, shared, prompts[0].token_ids, prefix)
        jobs = []
        for prompt in prompts:
            max_tokens = serving.max_tokens_for(
                req.requested_max_tokens, len(prompt.token_ids), "prompt"
            )
            jobs.append((prompt.token_ids, serving.sampling_params(req, max_tokens)))
        request_id = random_id("cmpl")
        found = structured_outputs_for(req)
        if found is not None:  # one constraint for every prompt: compiled once, before queueing
            await serving.compile_constraints(jobs, found[1], tenant)
        submitted = serving.submit_all(jobs, req, request_id, tenant)
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
        prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}
        async for prompt_index, out in outputs:
            num_cached[prompt_index] = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                prompt_logprobs[prompt_index] = out.prompt_logprobs
            for c in out.outputs:
                index = prompt_index * req.n + c.index
                texts[index] = c.text
                num_tokens[index] = len(c.token_ids)
                finish[index] = (c.finish_reason, c.stop_reason)
                logprobs.setdefault(index, []).extend(delta_logprobs(c))
        choices = []
        for index in sorted(texts):
            prompt_index = index // req.n
            prefix = prompts[prompt_index].text if req.echo else ""
            lps = None
            if req.logprobs is not None:
                lps = self.logprobs(logprobs[index], len(prefix))
                if req.echo:
                    echoed = self.echo_logprobs(
                        prompt_logprobs.get(prompt_index, []), prompts[prompt_index]
                    )
                    lps = {key: echoed[key] + lps[key] for key in lps}
            choice: dict[str, Any] = {
                "index": index,
                "text": prefix + texts[index],
                "logprobs": lps,
                "finish_reason": finish[index][0],
                "stop_reason": finish[index][1],
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs(
                    prompt_logprobs.get(prompt_index, [])
                )
            choices.append(choice)
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

        # Echoed prompts with logprobs wait for the prompt's logprobs (on its first output).
        reading_prompt = req.echo and req.logprobs is not None
        if req.echo and not reading_prompt:
            for index in range(len(prompts) * req.n):
                yield chunk([choice(index, prompts[index // req.n].text)])
        offsets: dict[int, int] = {}
        first_seen: set[int] = set()
        try:
            async for prompt_index, out in outputs:
                num_cached[prompt_index] = out.num_cached_tokens
                for c in out.outputs:
                    index = prompt_index * req.n + c.index
                    if index not in first_seen:
                        first_seen.add(index)
                        for event in self.first_chunks(req, prompts, index, out, chunk, choice):
                            yield event
                        offsets[index] = len(prompts[prompt_index].text) if req.echo else 0
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

    def first_chunks(
        self,
        req: CompletionRequest,
        prompts: list[Prompt],
        index: int,
        out: RequestOutput,
        chunk: Any,
        choice: Any,
    ) -> list[bytes]:
        """What a stream sends before a choice's first tokens: the echoed prompt with its
        logprobs, and vLLM's ``prompt_logprobs``."""
        events = []
        read = out.prompt_logprobs or []
        if req.echo and req.logprobs is not None:
            prompt = prompts[index // req.n]
            echoed = self.echo_logprobs(read, prompt)
            events.append(chunk([choice(index, prompt.text, logprobs=echoed)]))
        if req.prompt_logprobs is not None:
            first = dict(choice(index, ""), prompt_logprobs=self.prompt_logprobs(read))
            events.append(chunk([first]))
        return events

    def echo_logprobs(self, entries: list[TokenLogprob | None], prompt: Prompt) -> dict[str, Any]:
        """OpenAI's legacy ``logprobs`` of an echoed prompt: the first token has none."""
        serving = self.serving
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = 0
        for position, entry in enumerate(entries):
            if entry is None:  # the first token: nothing predicts it
                text = serving.token_text(prompt.token_ids[position])
                tokens.append(text)
                token_logprobs.append(None)
                top.append(None)
                offsets.append(offset)
                offset += len(text)
                continue
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

    def prompt_logprobs(
        self, entries: list[TokenLogprob | None]
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, the token and the top alternatives
        by id, each with its logprob, rank (1 = best; None when outside the top) and text."""
        serving = self.serving
        result: list[dict[str, dict[str, Any]] | None] = []
        for entry in entries:
            if entry is None:
                result.append(None)
                continue
            ranks = {tid: rank for rank, (tid, _) in enumerate(entry.top_logprobs, start=1)}
            item = {
                str(tid): {
                    "logprob": serving.logprob_value(lp),
                    "rank": rank,
                    "decoded_token": serving.token_text(tid),
                }
                for rank, (tid, lp) in enumerate(entry.top_logprobs, start=1)
            }
            item.setdefault(
                str(entry.token_id),
                {
                    "logprob": serving.logprob_value(entry.logprob),
                    "rank": ranks.get(entry.token_id),
                    "decoded_token": serving.token_text(entry.token_id),
                },
            )
            result.append(item)
        return result

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
