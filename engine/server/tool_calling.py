"""Tool calling for chat completions: what a request's ``tools`` and ``tool_choice`` mean here.

:func:`plan_tools` checks the request's tool fields once and decides three things, kept in a
:class:`ToolPlan`: which tools the model is shown, which parser reads its reply, and the JSON
schema the grammar must enforce (``required`` and named choices, so that the arguments always
validate against the function's schema). :func:`render_messages` turns the conversation, with
its tool calls and tool results, into what the chat template takes: through the template itself
when it knows about ``tools``, else through the default tool template below.
:class:`ToolCallDeltas` turns the parser's results into OpenAI's streamed tool-call deltas.

The default tool template (for templates without tool support, SmolLM2's among them) is
Hermes-shaped, so the ``hermes`` parser reads it: a system preamble lists each function as JSON
inside ``<tools></tools>`` and asks for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``;
an assistant turn's tool calls are rendered in that form after its content, and a tool result is
a user turn holding ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.meta

from engine.sampling_params import ParameterError
from engine.server.protocol_chat import ChatCompletionRequest, ChatMessage, ToolDefinition
from engine.server.tool_parsers import JsonToolCallParser, ParsedOutput, ToolParser, tool_parser
from engine.structured_output.limits import ConstraintLimits, check_tools_limits
from portico.errors import InvalidRequestError

TOOLS_PREAMBLE = (
    "You can call functions to answer the user. Each function is described by a JSON schema "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with the function's name and its arguments inside "
    "<tool_call></tool_call>, one block per call:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)
REQUIRED_NOTE = "\nYou must call at least one of these functions now."
NAMED_NOTE = "\nYou must call the function {name} now."


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools.

    ``tools`` are shown to the model (empty: none); ``parser`` reads the reply (None: the reply
    is plain content); ``schema`` is what the grammar enforces (None: nothing is enforced).
    """

    tools: list[ToolDefinition] = field(default_factory=list)
    parser: ToolParser | None = None
    schema: dict[str, Any] | None = None
    note: str = ""  # appended to the default template's preamble


NO_TOOLS = ToolPlan()


def plan_tools(
    req: ChatCompletionRequest,
    parser_name: str | None,
    auto_tool_choice: bool,
    limits: ConstraintLimits | None = None,
) -> ToolPlan:
    """The plan for ``req``, or a 400 naming the parameter that does not fit.

    ``parser_name`` and ``auto_tool_choice`` are the server's ``--tool-call-parser`` and
    ``--enable-auto-tool-choice``: as in vLLM, ``tool_choice="auto"`` needs both, while
    ``required`` and named choices need neither (the grammar fixes the reply's shape).
    ``limits`` (None: the defaults) caps the number and size of the tools; the grammar built
    from their parameters meets the schema limits when it is checked.
    """
    tools = req.tools or []
    if tools:
        try:
            check_tools_limits(tools, limits or ConstraintLimits())
        except ParameterError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequestError(
                f"Invalid value for 'tools': the function name {name!r} is given twice.",
                param=f"tools[{i}].function.name",
            )
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise InvalidRequestError(
                "Invalid value for 'tools': a function's parameters must be a JSON schema of "
                "type 'object'.",
                param=f"tools[{i}].function.parameters",
            )
    if choice == "none":
        return NO_TOOLS
    if not tools:
        raise InvalidRequestError(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
            "specified.",
            param="tool_choice",
        )
    if choice == "auto":
        if not (auto_tool_choice and parser_name):
            raise InvalidRequestError(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                "and --tool-call-parser.",
                param="tool_choice",
            )
        parser = tool_parser(parser_name)
        return ToolPlan(tools, parser if req.parallel_tool_calls else FirstCallOnly(parser))
    if choice == "required":
        one = [call_schema(t) for t in tools]
        item = one[0] if len(one) == 1 else {"anyOf": one}
        if req.parallel_tool_calls:
            item = {"type": "array", "items": item, "minItems": 1}
        return ToolPlan(tools, JsonToolCallParser(), item, REQUIRED_NOTE)
    wanted = choice.function.name  # the named form: pydantic admits nothing else
    for tool in tools:
        if tool.function.name == wanted:
            note = NAMED_NOTE.format(name=wanted)
            return ToolPlan(tools, JsonToolCallParser(), call_schema(tool), note)
    raise InvalidRequestError(
        f"Invalid value for 'tool_choice': no function named {wanted!r} is in 'tools'.",
        param="tool_choice",
    )


class FirstCallOnly:
    """``parallel_tool_calls: false`` under ``auto``: the reply's first call, and no other.

    Dropping the later calls keeps the parser monotone, so streaming stays exact.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser

    def parse(self, text: str, final: bool) -> ParsedOutput:
        parsed = self.parser.parse(text, final)
        return ParsedOutput(parsed.content, parsed.calls[:1])


def call_schema(tool: ToolDefinition) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``: its name, and arguments that fit its schema."""
    arguments = tool.function.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# ---------------------------------------------------------------------- rendering


def template_supports_tools(chat_template: Any) -> bool:
    """Whether the chat template reads a ``tools`` variable (then tools are rendered by it)."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    env = jinja2.Environment()
    for source in templates:
        try:
            if "tools" in jinja2.meta.find_undeclared_variables(env.parse(source)):
                return True
        except jinja2.TemplateError:
            continue  # transformers' own environment will report a broken template
    return False


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # replayed as the client sent it


def render_messages(
    messages: list[ChatMessage], plan: ToolPlan, native: bool
) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """The conversation and the ``tools`` argument for ``apply_chat_template``.

    ``native``: the template supports tools, so tool calls, tool results and the tool list go to
    it in the shape Hugging Face templates expect. Otherwise the default tool template applies.
    """
    if native:
        conversation = [_native_message(m) for m in messages]
        tools = [t.model_dump(exclude_none=True) for t in plan.tools] or None
        return conversation, tools
    conversation = [_default_message(m) for m in messages]
    if plan.tools:
        listing = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in plan.tools)
        preamble = TOOLS_PREAMBLE.format(tools=listing) + plan.note
        if conversation and conversation[0]["role"] == "system":
            first = conversation[0]
            conversation[0] = dict(first, content=f"{first['content']}\n\n{preamble}")
        else:
            conversation.insert(0, {"role": "system", "content": preamble})
    return conversation, None


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def _native_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(message), "content": message.template_content()}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments_value(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _default_message(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text()}\n</tool_response>"}
    if message.images():  # a user turn: no tool calls to append
        return {"role": _role(message), "content": message.template_content()}
    content = message.text()
    for call in message.tool_calls or []:
        body = {"name": call.function.name, "arguments": _arguments_value(call.function.arguments)}
        block = f"<tool_call>\n{json.dumps(body)}\n</tool_call>"
        content = f"{content}\n{block}" if content else block
    return {"role": _role(message), "content": content}


# ---------------------------------------------------------------------- replies


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def reply_message(parsed: ParsedOutput, call_ids: list[str]) -> dict[str, Any]:
    """OpenAI's assistant ``message`` for a parsed reply (``call_ids`` one per call)."""
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}
    return {
        "role": "assistant",
        "content": parsed.content or None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call_id, call in zip(call_ids, parsed.calls, strict=True)
        ],
    }


def finish_reason(engine_reason: str | None, parsed: ParsedOutput) -> str | None:
    """``tool_calls`` for a reply that called tools and ended by itself; else the engine's."""
    return "tool_calls" if parsed.calls and engine_reason == "stop" else engine_reason


class ToolCallDeltas:
    """The streamed view of one choice: each update returns what is new since the last.

    ``update(text, final)`` gets the whole text generated so far and returns the content delta
    and OpenAI's tool-call deltas (``index``, ``id``, ``type`` and the name on a call's first
    delta, then arguments in pieces). The parser is monotone, so the deltas concatenate to the
    parse of the whole text: the non-streamed reply.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.num_content_sent = 0
        self.num_arguments_sent: list[int] = []
        self.call_ids: list[str] = []
        self.parsed = ParsedOutput("")

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        parsed = self.parser.parse(text, final)
        self.parsed = parsed
        content = parsed.content[self.num_content_sent :]
        self.num_content_sent = len(parsed.content)
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.call_ids):
                self.call_ids.append(new_call_id())
                self.num_arguments_sent.append(len(call.arguments))
                deltas.append(
                    {
                        "index": index,
                        "id": self.call_ids[index],
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
            elif len(call.arguments) > self.num_arguments_sent[index]:
                piece = call.arguments[self.num_arguments_sent[index] :]
                self.num_arguments_sent[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": piece}})
        return content, deltas
