"""``POST /v1/responses``: OpenAI's Responses API rendered onto the chat engine request.

A Responses request becomes a :class:`ChatCompletionRequest` (``instructions`` -> a system
turn; ``input`` items -> chat turns, ``function_call`` items -> an assistant turn's tool calls,
``function_call_output`` -> a tool turn; function ``tools``, ``tool_choice``, ``text.format`` ->
``response_format``) and runs through :meth:`ChatServing.start`, so the chat template, tool
calling and structured outputs are the chat endpoint's own. The reply comes back as output
items (a ``message`` with ``output_text``, ``function_call`` items), whole or as the Responses
stream events (``response.created`` ... ``response.completed``).

Stored responses and ``previous_response_id`` live in the gateway (per tenant, in Redis): it
sends the engine the whole conversation with ``previous_input_included`` set. The engine alone
keeps nothing; it refuses ``previous_response_id`` without that flag.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import CompletionOutput
from engine.server.engine_requests import EngineStreamingResponse, merge, unless_disconnected
from engine.server.protocol import describe_validation_error
from engine.server.protocol_chat import ChatCompletionRequest
from engine.server.protocol_responses import ResponsesRequest
from engine.server.serving_chat import ChatServing, StartedChat
from engine.server.serving_engine import tenant_of
from engine.server.tool_calling import ToolCallDeltas, new_call_id
from engine.server.tool_parsers import ParsedOutput
from portico.errors import APIError, InvalidRequestError

TEXT_PART_TYPES = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, param: str) -> str:
    """The text of a message's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"Invalid type for '{param}'.", param=param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            continue
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"Invalid value for '{param}[{i}]': content part type {kind!r} is not supported "
                f"by this engine (only {', '.join(TEXT_PART_TYPES)} are).",
                param=f"{param}[{i}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _content_of(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A user message's content as chat takes it: its text, or, with ``input_image`` parts
    (``{"type": "input_image", "image_url": "data:..."}``), chat's text and ``image_url``
    parts in the order given (a vision model reads them: engine/server/chat_images.py)."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    ):
        return _text_of(content, param)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                where = f"{param}[{i}].image_url"
                raise InvalidRequestError(f"Missing required parameter: '{where}'.", param=where)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind != "refusal":
            raise InvalidRequestError(
                f"Invalid value for '{param}[{i}]': content part type {kind!r} is not supported "
                f"by this engine (input_image and {', '.join(TEXT_PART_TYPES)} are).",
                param=f"{param}[{i}]",
            )
    return parts


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"Missing required parameter: '{param}.{key}'.", param=param)
    return value


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat turns of a Responses request (400 naming the first bad input item)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for i, item in enumerate(req.input):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(
                    f"Invalid value for '{param}.role': must be user, assistant, system or "
                    "developer.",
                    param=f"{param}.role",
                )
            content = item.get("content")
            where = f"{param}.content"
            text = _content_of(content, where) if role == "user" else _text_of(content, where)
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _string(item, "name", param),
                    "arguments": _string(item, "arguments", param),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            call_id = _string(item, "call_id", param)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # this engine produces no reasoning items; a replayed one adds nothing
        else:
            raise InvalidRequestError(
                f"Invalid value for '{param}.type': input items of type {kind!r} are not "
                "supported by this engine (message, function_call, function_call_output are).",
                param=f"{param}.type",
            )
    if not messages:
        raise InvalidRequestError("The input must hold at least one message.", param="input")
    return messages


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers ``req``."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "top_k": req.top_k,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = req.text.format if req.text is not None else None
    data = {k: v for k, v in body.items() if v is not None}
    try:
        chat = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise InvalidRequestError(message, param=param) from None
    if fmt is not None:
        chat.response_format = fmt.response_format()
    return chat


class ResponsesServing:
    """Answers Responses API requests for one model through the chat machinery."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        if req.previous_response_id is not None and not req.previous_input_included:
            raise InvalidRequestError(
                "previous_response_id needs Portico's gateway: stored responses are kept "
                "there, per tenant. Send the earlier turns in 'input' to the engine directly.",
                param="previous_response_id",
                code="unsupported_parameter",
            )
        started = await self.chat.start(
            chat_request(req), new_id("resp"), tenant_of(request.headers)
        )
        if req.stream:
            return EngineStreamingResponse(self.stream(req, started), started.submitted)
        body = await unless_disconnected(self.collect(req, started), request)
        return JSONResponse(body)

    # ------------------------------------------------------------------ the response object

    def response_object(
        self,
        req: ResponsesRequest,
        response_id: str,
        created_at: int,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        tool_choice: Any = req.tool_choice or "auto"
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        return {
            "id": response_id,
            "object": "response",
            "created_at": created_at,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.chat.serving.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {
                "format": (
                    fmt.model_dump(by_alias=True, exclude_none=True)
                    if fmt is not None
                    else {"type": "text"}
                )
            },
            "tool_choice": tool_choice,
            "tools": [t.model_dump() for t in req.tools or []],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation,
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    @staticmethod
    def usage(num_prompt: int, num_output: int, num_cached: int) -> dict[str, Any]:
        return {
            "input_tokens": num_prompt,
            "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt + num_output,
        }

    @staticmethod
    def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": item_id,
            "status": status,
            "role": "assistant",
            "content": content if status == "completed" else [],
        }

    @staticmethod
    def call_item(
        item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
    ) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def output_items(self, parsed: ParsedOutput, call_ids: list[str]) -> list[dict[str, Any]]:
        items = []
        if parsed.content or not parsed.calls:
            items.append(self.message_item(new_id("msg"), parsed.content))
        for call, call_id in zip(parsed.calls, call_ids, strict=True):
            items.append(self.call_item(new_id("fc"), call_id, call.name, call.arguments))
        return items

    async def collect(self, req: ResponsesRequest, started: StartedChat) -> dict[str, Any]:
        created_at = int(time.time())
        final: CompletionOutput | None = None
        num_cached = 0
        async for _, out in merge(started.submitted):
            num_cached = out.num_cached_tokens
            final = out.outputs[0]
        assert final is not None  # an engine request always ends with an output
        plan = started.plan
        if plan.parser is not None:
            parsed = plan.parser.parse(final.text, final=True)
        else:
            parsed = ParsedOutput(final.text)
        output = self.output_items(parsed, [new_call_id() for _ in parsed.calls])
        status = "incomplete" if final.finish_reason == "length" else "completed"
        usage = self.usage(started.num_prompt_tokens, len(final.token_ids), num_cached)
        return self.response_object(req, started.request_id, created_at, status, output, usage)

    # ------------------------------------------------------------------ streaming

    async def stream(self, req: ResponsesRequest, started: StartedChat) -> AsyncIterator[bytes]:
        events = ResponseEvents()
        created_at = int(time.time())
        rid = started.request_id

        def snapshot(status: str, output: list[dict[str, Any]], usage: Any = None) -> Any:
            return self.response_object(req, rid, created_at, status, output, usage)

        yield events.emit("response.created", response=snapshot("in_progress", []))
        yield events.emit("response.in_progress", response=snapshot("in_progress", []))
        plan = started.plan
        deltas = ToolCallDeltas(plan.parser) if plan.parser is not None else None
        text = ""
        message: dict[str, Any] | None = None  # the open message item, once text appears
        message_text = ""
        calls: list[dict[str, Any]] = []
        output: list[dict[str, Any]] = []  # items in output_index order
        num_cached = 0
        final: CompletionOutput | None = None
        try:
            async for _, out in merge(started.submitted):
                num_cached = out.num_cached_tokens
                c = out.outputs[0]
                final = c
                content = c.text_delta
                call_deltas: list[dict[str, Any]] = []
                if deltas is not None:
                    text += c.text_delta
                    content, call_deltas = deltas.update(text, c.finish_reason is not None)
                if content:
                    if message is None:
                        message = self.message_item(new_id("msg"), "", "in_progress")
                        output.append(message)
                        yield events.emit(
                            "response.output_item.added",
                            output_index=len(output) - 1,
                            item=message,
                        )
                        yield events.emit(
                            "response.content_part.added",
                            item_id=message["id"],
                            output_index=len(output) - 1,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    message_text += content
                    yield events.emit(
                        "response.output_text.delta",
                        item_id=message["id"],
                        output_index=output.index(message),
                        content_index=0,
                        delta=content,
                        logprobs=[],
                    )
                for delta in call_deltas:
                    for event in self._call_events(delta, calls, output, events):
                        yield event
        except Exception as exc:
            error = exc if isinstance(exc, APIError) else None
            yield events.emit(
                "error",
                code=error.code if error else "internal_error",
                message=error.message if error else "The engine failed on this response.",
                param=error.param if error else None,
            )
            return
        items: list[dict[str, Any]] = []
        for event in self._done_events(output, message, message_text, events, items):
            yield event
        if not items:  # no text and no call: still one (empty) message, as the whole reply has
            items.append(self.message_item(new_id("msg"), ""))
        num_output = len(final.token_ids) if final is not None else 0
        incomplete = final is not None and final.finish_reason == "length"
        usage = self.usage(started.num_prompt_tokens, num_output, num_cached)
        # Always response.completed (the SDK's stream helper waits for it), its status saying
        # "incomplete" when max_output_tokens cut the reply.
        status = "incomplete" if incomplete else "completed"
        yield events.emit("response.completed", response=snapshot(status, items, usage))

    def _done_events(
        self,
        output: list[dict[str, Any]],
        message: dict[str, Any] | None,
        message_text: str,
        events: ResponseEvents,
        items: list[dict[str, Any]],
    ) -> list[bytes]:
        """The closing events of each output item in output order (the message's text and
        part, a call's arguments, then the item); each finished item is appended to
        ``items``."""
        emitted: list[bytes] = []
        for item in output:
            index = len(items)
            if item is message:
                done = self.message_item(item["id"], message_text)
                part = done["content"][0]
                emitted.append(
                    events.emit(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=message_text,
                        logprobs=[],
                    )
                )
                emitted.append(
                    events.emit(
                        "response.content_part.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                )
            else:
                done = dict(item, status="completed")
                emitted.append(
                    events.emit(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            items.append(done)
            emitted.append(events.emit("response.output_item.done", output_index=index, item=done))
        return emitted

    def _call_events(
        self,
        delta: dict[str, Any],
        calls: list[dict[str, Any]],
        output: list[dict[str, Any]],
        events: ResponseEvents,
    ) -> list[bytes]:
        """The events of one chat tool-call delta: a new function_call item, then its
        arguments in pieces."""
        emitted = []
        index = delta["index"]
        function = delta.get("function") or {}
        if index == len(calls):
            item = self.call_item(new_id("fc"), delta["id"], function["name"], "", "in_progress")
            calls.append(item)
            output.append(item)
            added = dict(item)
            emitted.append(
                events.emit("response.output_item.added", output_index=len(output) - 1, item=added)
            )
        item = calls[index]
        piece = function.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            emitted.append(
                events.emit(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=output.index(item),
                    delta=piece,
                )
            )
        return emitted


class ResponseEvents:
    """Numbers and frames the events of one response stream (``event:`` + ``data:`` lines, as
    OpenAI sends them; no ``[DONE]``)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def emit(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        data = json.dumps(payload, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()
