"""``POST /v1/chat/completions``: messages through the chat template, then one engine request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.multimodal import ImageInput, parse_limit_mm_per_prompt
from engine.outputs import CompletionOutput, TokenLogprob
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.server import sse
from engine.server.chat_images import ChatImages
from engine.server.engine_requests import (
    EngineRequest,
    EngineStreamingResponse,
    merge,
    unless_disconnected,
)
from engine.server.protocol_chat import ChatCompletionRequest, ChatMessage
from engine.server.serving_engine import (
    OpenAIServing,
    delta_logprobs,
    random_id,
    tenant_of,
    usage,
)
from engine.server.shared_prefix import salt_with_prefix
from engine.server.structured_fields import structured_outputs_for
from engine.server.tool_calling import (
    NO_TOOLS,
    ToolCallDeltas,
    ToolPlan,
    finish_reason,
    new_call_id,
    plan_tools,
    render_messages,
    reply_message,
    template_supports_tools,
)
from engine.tenancy import TenantTag
from portico.contract import (
    PROMPT_IDS_FIELD,
    SharedPrefix,
    carried_prompt_ids,
    shared_prefix_of,
)
from portico.errors import InvalidRequestError
from portico.media_fetch import MediaPolicy


@dataclass
class StartedChat:
    """A chat request queued in the engine: its tool plan, id, prompt size and requests."""

    plan: ToolPlan
    request_id: str
    num_prompt_tokens: int
    submitted: list[EngineRequest]


class ChatServing:
    """Answers chat completions for one model, streaming or not, in OpenAI's exact shapes.

    ``tool_call_parser`` and ``auto_tool_choice`` are the server's ``--tool-call-parser`` and
    ``--enable-auto-tool-choice`` (see :func:`~engine.server.tool_calling.plan_tools`).
    """

    def __init__(
        self,
        serving: OpenAIServing,
        tool_call_parser: str | None = None,
        auto_tool_choice: bool = False,
        media: MediaPolicy | None = None,
    ) -> None:
        self.serving = serving
        self.tool_call_parser = tool_call_parser
        self.auto_tool_choice = auto_tool_choice
        template = getattr(serving.tokenizer, "chat_template", None)
        self.native_tools = bool(template) and template_supports_tools(template)
        engine = serving.engine.engine
        model = getattr(getattr(engine, "runner", None), "model", None)
        limit = parse_limit_mm_per_prompt(getattr(engine.config, "limit_mm_per_prompt", None))
        self.images = ChatImages(model, limit, media)

    def prompt_token_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        plan: ToolPlan = NO_TOOLS,
    ) -> list[int]:
        """:meth:`render`'s token ids (each image's placeholder run included)."""
        return self.render(messages, add_generation_prompt, plan)[0]

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        plan: ToolPlan = NO_TOOLS,
        mm_options: dict[str, Any] | None = None,
    ) -> tuple[list[int], list[ImageInput]]:
        """Render the conversation (and the plan's tools) with the chat template; tokenize it;
        expand its images' placeholders (engine/server/chat_images.py; ``mm_options``: the
        request's ``mm_processor_kwargs``)."""
        images = self.images.decode(messages)  # bad image parts fail before the template runs
        tokenizer = self.serving.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "This model has no chat template; use /v1/completions instead.",
                param="messages",
            )
        conversation, tools = render_messages(messages, plan, self.native_tools)
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja raises for conversations the template refuses
            raise InvalidRequestError(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from None
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return self.images.attach(ids, images, mm_options)

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        carried = carried_prompt_ids(
            request.headers, req.portico_prompt_token_ids, self.serving.tokenizer_fingerprint
        )
        started = await self.start(
            req,
            tenant=tenant_of(request.headers),
            shared=shared_prefix_of(request.headers),
            carried=carried,
        )
        plan, request_id, num_prompt = started.plan, started.request_id, started.num_prompt_tokens
        outputs = merge(started.submitted)
        if req.stream:
            return EngineStreamingResponse(
                self.stream(req, plan, request_id, num_prompt, outputs), started.submitted
            )
        body = await unless_disconnected(
            self.collect(req, plan, request_id, num_prompt, outputs), request
        )
        return JSONResponse(body)

    async def start(
        self,
        req: ChatCompletionRequest,
        request_id: str | None = None,
        tenant: TenantTag | None = None,
        shared: SharedPrefix | None = None,
        carried: list[int] | None = None,
    ) -> StartedChat:
        """Check, render, compile its grammar and queue the request (the Responses API
        shares this). ``carried``: the prompt's ids as the gateway rendered them (see
        portico/contract.py), used instead of rendering when the request has no tools."""
        serving = self.serving
        serving.check_request(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true.", param="top_logprobs"
            )
        limits = serving.engine.engine.structured.limits
        plan = plan_tools(req, self.tool_call_parser, self.auto_tool_choice, limits)
        await self.images.fetch(req.messages)  # allowed image URLs, as data URLs
        if carried is not None and not plan.tools and self.plain_text(req.messages):
            serving.check_token_ids(carried, PROMPT_IDS_FIELD)
            prompt, images = list(carried), list[ImageInput]()
            self.serving.metrics.carried("chat")
        else:
            prompt, images = self.render(
                req.messages, plan=plan, mm_options=req.mm_processor_kwargs
            )
        if req.truncate_prompt_tokens is not None:  # vLLM's: keep the last N tokens
            prompt = prompt[-req.truncate_prompt_tokens :]
        elif shared is not None:  # the engine's salt for this request: the field's, widened
            req.cache_salt = self.shared_salt(req, prompt, shared)  # over the shared prefix
        max_tokens = serving.max_tokens_for(req.requested_max_tokens, len(prompt), "messages")
        params = serving.sampling_params(req, max_tokens)
        if plan.schema is not None:
            constrain_to_schema(params, plan.schema)
        request_id = request_id or random_id("chatcmpl")
        found = structured_outputs_for(req)
        param = "tools" if plan.schema is not None else found[1] if found else "structured_outputs"
        await serving.compile_constraints([(prompt, params)], param, tenant)
        try:
            submitted = serving.submit_all([(prompt, params)], req, request_id, tenant, images)
        except InvalidRequestError as exc:
            if plan.schema is None or exc.param != "structured_outputs":
                raise
            # The grammar was built from the functions' parameters: name what the user wrote.
            raise InvalidRequestError(
                f"A function's parameters schema cannot be enforced: {exc.message}",
                param="tools",
            ) from None
        return StartedChat(plan, request_id, len(prompt), submitted)

    @staticmethod
    def plain_text(messages: list[ChatMessage]) -> bool:
        """Every message is plain text: the gateway's rendering is the engine's own."""
        return all(isinstance(m.content, str) for m in messages)

    def shared_salt(
        self, req: ChatCompletionRequest, prompt: list[int], shared: SharedPrefix
    ) -> str | None:
        """The request's cache salt with the shared prefix its first message starts with
        (engine/server/shared_prefix.py): that message cut to the prefix, rendered alone."""
        first = req.messages[0]
        if not isinstance(first.content, str) or len(first.content) < shared.num_chars:
            return req.cache_salt
        cut = first.model_copy(update={"content": first.content[: shared.num_chars]})
        prefix = self.prompt_token_ids([cut], add_generation_prompt=False)
        return salt_with_prefix(req.cache_salt, shared, prompt, prefix)

    async def collect(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan,
        request_id: str,
        num_prompt_tokens: int,
        outputs: AsyncIterator[tuple[int, Any]],
    ) -> dict[str, Any]:
        final: dict[int, CompletionOutput] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        num_cached = 0
        async for _, out in outputs:
            num_cached = out.num_cached_tokens
            for choice in out.outputs:
                final[choice.index] = choice
                logprobs.setdefault(choice.index, []).extend(delta_logprobs(choice))
        choices = []
        for index in sorted(final):
            c = final[index]
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            reason = c.finish_reason
            if plan.parser is not None:
                parsed = plan.parser.parse(c.text, final=True)
                message = reply_message(parsed, [new_call_id() for _ in parsed.calls])
                reason = finish_reason(reason, parsed)
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": self.logprobs(logprobs[index]) if req.logprobs else None,
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": self.serving.created(),
            "model": self.serving.model_name,
            "choices": choices,
            "usage": usage(
                num_prompt_tokens, sum(len(c.token_ids) for c in final.values()), num_cached
            ),
        }

    async def stream(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan,
        request_id: str,
        num_prompt_tokens: int,
        outputs: AsyncIterator[tuple[int, Any]],
    ) -> AsyncIterator[bytes]:
        created = self.serving.created()
        include_usage = req.include_usage

        num_tokens: dict[int, int] = {}
        num_cached = 0

        def usage_so_far() -> dict[str, Any]:
            return usage(num_prompt_tokens, sum(num_tokens.values()), num_cached)

        chunk = sse.chunk_writer(
            request_id,
            "chat.completion.chunk",
            created,
            self.serving.model_name,
            include_usage,
            usage_so_far if req.continuous_usage else None,
        )

        def choice(
            index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
        ) -> dict[str, Any]:
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        for index in range(req.n):
            yield chunk([choice(index, {"role": "assistant", "content": ""})])
        texts: dict[int, str] = {}
        tool_deltas = {}
        if plan.parser is not None:
            tool_deltas = {index: ToolCallDeltas(plan.parser) for index in range(req.n)}
        try:
            async for _, out in outputs:
                num_cached = out.num_cached_tokens
                for c in out.outputs:
                    num_tokens[c.index] = len(c.token_ids)
                    reason = c.finish_reason
                    delta: dict[str, Any] = {"content": c.text_delta}
                    if c.index in tool_deltas:
                        texts[c.index] = texts.get(c.index, "") + c.text_delta
                        calls = tool_deltas[c.index]
                        content, call_deltas = calls.update(texts[c.index], reason is not None)
                        delta = {"content": content} if content else {}
                        if call_deltas:
                            delta["tool_calls"] = call_deltas
                        if reason is not None:
                            reason = finish_reason(reason, calls.parsed)
                    if (
                        delta.get("content")
                        or "tool_calls" in delta
                        or (req.logprobs and c.token_ids_delta)
                    ):
                        logprobs = self.logprobs(delta_logprobs(c)) if req.logprobs else None
                        yield chunk([choice(c.index, delta, logprobs=logprobs)])
                    if reason is not None:
                        yield chunk([choice(c.index, {}, reason)])
        except Exception as exc:
            yield sse.error_event(exc)
            yield sse.DONE
            return
        if include_usage:
            yield chunk([], usage=usage_so_far())
        yield sse.DONE

    def logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """OpenAI's chat ``logprobs`` object for these tokens."""
        serving = self.serving

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = serving.token_text(token_id)
            return {
                "token": text,
                "logprob": serving.logprob_value(logprob),
                "bytes": list(text.encode()),
            }

        return {
            "content": [
                dict(
                    item(e.token_id, e.logprob),
                    top_logprobs=[item(tid, lp) for tid, lp in e.top_logprobs],
                )
                for e in entries
            ]
        }


def constrain_to_schema(params: SamplingParams, schema: dict[str, Any]) -> None:
    """Make the grammar hold the reply to ``schema`` (tool_choice ``required`` or named).

    A request has one grammar: a tool choice that forces calls cannot also ask for another
    output format.
    """
    if params.structured_outputs is not None:
        raise InvalidRequestError(
            "tool_choice 'required' or a named function cannot be combined with "
            "response_format or structured_outputs.",
            param="tool_choice",
        )
    # Compact JSON, as OpenAI writes arguments: fewer tokens, and no runs of whitespace.
    params.structured_outputs = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
