"""The checks the gateway makes on a request body before any quota is looked at.

A malformed request is a 400 whatever the tenant's quotas say, and costs nothing: so the
gateway checks here what it can check alone (the shape of chat messages and their content
parts, the sampling fields' types and ranges) before routing and admission. The engine
validates the whole body again with its pydantic models (engine/server/protocol*.py) and
answers in the same words (:func:`portico.errors.type_error`); the bounds below are the
engine's, which are OpenAI's.
"""

from __future__ import annotations

from typing import Any

from gateway.body.image_parts import check_image_url
from portico.contract import pixel_options_error
from portico.errors import InvalidRequestError, type_error

# Roles whose message must carry content (an assistant turn may carry tool_calls instead).
CONTENT_ROLES = frozenset({"system", "developer", "user", "tool"})
# Content part types whose ``text`` must be a string (chat's and the Responses API's).
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})

# name -> (lowest, highest, lowest excluded): the numbers chat, completions and responses share
NUMBER_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, 10.0, True),
}
# name -> (lowest, highest): integers
INTEGER_RANGES: dict[str, tuple[int, int]] = {
    "top_k": (-1, 2**31 - 1),
    "seed": (-(2**63), 2**63 - 1),
    "min_tokens": (0, 2**31 - 1),
}


def _missing(param: str) -> InvalidRequestError:
    return InvalidRequestError(f"Missing required parameter: '{param}'.", param=param)


def _string(obj: dict[str, Any], key: str, param: str) -> str:
    """``obj[key]``, required and a string; else a 400 naming ``param``."""
    value = obj.get(key)
    if value is None:
        raise _missing(param)
    if not isinstance(value, str):
        raise type_error(param, value, "a string")
    return value


def check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat ``messages``: each an object with a string ``role``; system, developer, user and
    tool turns with content; content a string or an array of well-formed parts. Returns the
    list, checked; a 400 naming the first bad place (``messages[0].content[1].text``)."""
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise type_error(param, message, "a message object")
        role = _string(message, "role", f"{param}.role")
        content = message.get("content")
        if content is None:
            if role in CONTENT_ROLES:
                raise _missing(f"{param}.content")
        elif isinstance(content, list):
            check_parts(content, f"{param}.content")
        elif not isinstance(content, str):
            raise type_error(f"{param}.content", content, "a string or an array of content parts")
    return messages


def check_parts(parts: list[Any], param: str) -> None:
    """Content parts: objects with a string ``type``; a text part's ``text`` a string; an image
    part's ``image_url`` an object with a string ``url``. Other part types pass (the upstream
    says whether it reads them)."""
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise type_error(where, part, "a content part object")
        kind = _string(part, "type", f"{where}.type")
        if kind in TEXT_PART_TYPES:
            _string(part, "text", f"{where}.text")
        elif kind == "image_url":
            image = part.get("image_url")
            if image is None:
                raise _missing(f"{where}.image_url")
            if not isinstance(image, dict):
                raise type_error(f"{where}.image_url", image, "an object with a 'url'")
            url = image.get("url")
            if not isinstance(url, str):
                raise (_missing if url is None else _url_type)(f"{where}.image_url.url")
            check_image_url(url, f"{where}.image_url.url")


def _url_type(param: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid type for '{param}': expected a string.", param=param)


def check_sampling(body: dict[str, Any]) -> None:
    """The sampling fields' types and ranges (absent or null: not given); ``stop`` a string
    or an array of strings."""
    for name, (low, high, low_open) in NUMBER_RANGES.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise type_error(name, value, "a number")
        if value > high or value < low or (low_open and value == low):
            bound = f"greater than {low:g}" if low_open else f"at least {low:g}"
            raise InvalidRequestError(
                f"Invalid value for '{name}': must be {bound} and at most {high:g}; got {value}.",
                param=name,
            )
    for name, (lowest, highest) in INTEGER_RANGES.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise type_error(name, value, "an integer")
        if not lowest <= value <= highest:
            raise InvalidRequestError(
                f"Invalid value for '{name}': must be an integer from {lowest} to {highest}.",
                param=name,
            )
    options = body.get("mm_processor_kwargs")
    problem = None if options is None else pixel_options_error(options)
    if problem is not None:  # the engine's own check, before admission charges anything
        raise InvalidRequestError(
            f"Invalid value for '{problem[0]}': {problem[1]}.", param=problem[0]
        )
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list):
            raise type_error("stop", stop, "a string or an array of strings")
        for i, item in enumerate(stop):
            if not isinstance(item, str):
                raise type_error(f"stop[{i}]", item, "a string")


def check_prompt_items(value: str | list[Any], name: str) -> None:
    """A prompt (``prompt``, ``input``) that is an array: strings, token ids, or arrays of
    token ids; a 400 naming the first item that is none of these."""
    if isinstance(value, str):
        return
    for i, item in enumerate(value):
        if isinstance(item, str):
            continue
        if isinstance(item, int) and not isinstance(item, bool):
            continue
        if isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            continue
        raise type_error(f"{name}[{i}]", item, "a string, a token id or an array of token ids")
