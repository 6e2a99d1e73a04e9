"""Image parts of chat messages, checked at the edge before admission charges anything.

A ``data:`` URL must be ``data:image/<type>;base64,<payload>`` whose payload is valid base64,
at most :data:`MAX_IMAGE_BYTES` decoded, and starts as a PNG, JPEG, WebP or GIF file does
(the formats the engine decodes). An ``http(s)`` URL passes the shape check: a remote
provider gets it unchanged; for a local engine the gateway fetches it first, under the
operator's :class:`MediaSettings` (portico/media_fetch.py), and sends the engine the image as
a data URL (:func:`inline_image_urls`), so the engine never fetches on the gateway's behalf.
The engine decodes the picture itself and answers a 400 naming the part for a file that is
cut short or corrupt.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from portico.errors import InvalidRequestError
from portico.media_fetch import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_MEDIA_BYTES,
    MediaFetcher,
    MediaPolicy,
    image_type,
    parse_networks,
)

MAX_IMAGE_BYTES = 20 * 2**20  # OpenAI's own limit per image


class MediaSettings(BaseModel):
    """``media:`` in the gateway config: which image URLs the gateway fetches for local
    engines (``portico serve --allowed-media-domains ...``). No domains: none."""

    model_config = ConfigDict(extra="forbid")

    allowed_domains: list[str] = []  # exact host names, e.g. upload.wikimedia.org
    allowed_networks: list[str] = []  # CIDRs a private address may be in, e.g. 10.0.0.0/8
    max_bytes: int = Field(default=DEFAULT_MAX_MEDIA_BYTES, ge=1024)
    fetch_timeout_s: float = Field(default=DEFAULT_FETCH_TIMEOUT_S, gt=0, le=300)

    @field_validator("allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        parse_networks(value)
        return value

    def policy(self) -> MediaPolicy:
        return MediaPolicy.of(
            self.allowed_domains, self.allowed_networks, self.max_bytes, self.fetch_timeout_s
        )


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
    if image_type(raw) is None:
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


async def inline_image_urls(messages: list[dict[str, Any]], fetcher: MediaFetcher) -> int:
    """Fetch every ``http(s)`` image URL of the (checked) chat messages and put the image in
    its place as a data URL; returns how many were fetched. A 400 naming the part
    (``messages[0].content[1].image_url.url``) for a URL the policy refuses or a failed
    fetch; the fetches run one after another, so the first bad part is the one named."""
    fetched = 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            image = part["image_url"]
            if image["url"].startswith(("http://", "https://")):
                param = f"messages[{i}].content[{j}].image_url.url"
                image["url"] = await fetcher.data_url(image["url"], param)
                fetched += 1
    return fetched
