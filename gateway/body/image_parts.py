"""Image parts of chat messages, checked at the edge before admission charges anything.

A ``data:`` URL must be ``data:image/<type>;base64,<payload>`` whose payload is valid base64,
at most :data:`MAX_IMAGE_BYTES` decoded, and starts as a PNG, JPEG, WebP or GIF file does
(the formats the engine decodes). An ``http(s)`` URL passes: a remote provider may fetch it;
a local engine refuses it with its own 400 (it fetches nothing). The engine decodes the
picture itself and answers a 400 naming the part for a file that is cut short or corrupt.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from portico.errors import InvalidRequestError

MAX_IMAGE_BYTES = 20 * 2**20  # OpenAI's own limit per image
# File signatures of the formats the engine decodes (engine/multimodal.py IMAGE_FORMATS).
_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")


def _looks_like_image(raw: bytes) -> bool:
    if raw.startswith(_SIGNATURES):
        return True
    return raw[:4] == b"RIFF" and raw[8:12] == b"WEBP"


def check_image_url(url: str, param: str) -> None:
    """A 400 naming ``param`` for a data URL the engine could not use, or another scheme."""
    if url.startswith(("http://", "https://")):
        return
    header, comma, payload = url.partition(",")
    if not url.startswith("data:image/") or not comma or not header.endswith(";base64"):
        raise InvalidRequestError(
            f"Invalid value for '{param}': expected a data URL "
            "(data:image/png;base64,...) or an http(s) URL.",
            param=param,
        )
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidRequestError(
            f"Invalid value for '{param}': the image is larger than {MAX_IMAGE_BYTES} bytes.",
            param=param,
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(
            f"Invalid value for '{param}': the data URL's payload is not valid base64.",
            param=param,
        ) from None
    if not _looks_like_image(raw):
        raise InvalidRequestError(
            f"Invalid value for '{param}': the data is not a PNG, JPEG, WebP or GIF image.",
            param=param,
        )


def num_images(messages: list[dict[str, Any]] | None) -> int:
    """How many image parts the (checked) messages carry."""
    count = 0
    for message in messages or ():
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image_url")
    return count


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: each image part as transformers'
    ``{"type": "image"}`` (as the engine renders them), the rest unchanged."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content
        ):
            parts = [
                {"type": "image"} if isinstance(p, dict) and p.get("type") == "image_url" else p
                for p in content
            ]
            message = {**message, "content": parts}
        out.append(message)
    return out


def image_urls(messages: list[dict[str, Any]] | None) -> list[str]:
    """The (checked) messages' image URLs, in order."""
    return [
        part["image_url"]["url"]
        for message in messages or ()
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]


def image_size(url: str) -> tuple[int, int] | None:
    """``(width, height)`` of a data URL's picture, read from its header only (Pillow opens
    lazily); None for an http(s) URL or a file Pillow cannot read (the engine names it)."""
    if not url.startswith("data:"):
        return None
    try:
        from PIL import Image

        raw = base64.b64decode(url.partition(",")[2], validate=True)
        with Image.open(io.BytesIO(raw)) as image:
            return int(image.width), int(image.height)
    except Exception:  # any unreadable picture: the engine answers the 400
        return None
