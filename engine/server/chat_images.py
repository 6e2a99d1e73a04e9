"""Image parts of chat messages, turned into what the engine takes (engine/multimodal.py).

Every image part is checked before anything is queued: a text-only model, too many images
(``--limit-mm-per-prompt``), a URL that is not a ``data:`` URL, bad base64, bytes that are not
a picture of a supported format: each is a 400 in OpenAI's shape naming the part
(``messages[2].content[1].image_url.url``). A request's ``mm_processor_kwargs`` (Qwen2-VL's
``min_pixels``/``max_pixels``) are checked by the model; a bad one is a 400 naming the key.
"""

from __future__ import annotations

from typing import Any

from engine.multimodal import ImageError, ImageInput, attach_images, decode_data_url
from engine.server.protocol_chat import ChatMessage
from portico.errors import InvalidRequestError
from portico.media_fetch import MediaFetcher, MediaPolicy


class ChatImages:
    """The image half of rendering a chat prompt for one served model.

    ``model`` is the engine's model (a vision model has ``vision`` and ``image_processor``);
    ``max_images`` is ``--limit-mm-per-prompt``'s image count; ``media`` which ``http(s)``
    URLs :meth:`fetch` may fetch (``--allowed-media-domains``; default none).
    """

    def __init__(self, model: Any, max_images: int, media: MediaPolicy | None = None) -> None:
        self.model = model
        self.max_images = max_images
        self.accepts_images = getattr(model, "vision", None) is not None
        self.fetcher = MediaFetcher(media) if media is not None and media.enabled else None

    async def fetch(self, messages: list[ChatMessage]) -> None:
        """Each ``http(s)`` image URL replaced by the fetched image as a data URL, when this
        server fetches images (a 400 naming the part for a refused URL or a failed fetch);
        otherwise nothing (:meth:`decode` refuses the URL). Only for a model that takes
        images, and within ``--limit-mm-per-prompt``: nothing is fetched for a prompt that
        :meth:`decode` would refuse anyway."""
        if self.fetcher is None or not self.accepts_images:
            return
        parts = [part for message in messages for _, part in message.images()]
        if len(parts) > self.max_images:
            return
        for m, message in enumerate(messages):
            for p, part in message.images():
                if part.image_url.url.startswith(("http://", "https://")):
                    param = f"messages[{m}].content[{p}].image_url.url"
                    part.image_url.url = await self.fetcher.data_url(part.image_url.url, param)

    def decode(self, messages: list[ChatMessage]) -> list[Any]:
        """The messages' images as Pillow images, in message order. InvalidRequestError
        naming the part for anything the engine cannot use."""
        parts = [
            (f"messages[{m}].content[{p}].image_url.url", part.image_url.url)
            for m, message in enumerate(messages)
            for p, part in message.images()
        ]
        if not parts:
            return []
        if not self.accepts_images:
            raise InvalidRequestError(
                "This model does not accept images (it is not a vision-language model).",
                param=parts[0][0],
            )
        if len(parts) > self.max_images:
            raise InvalidRequestError(
                f"At most {self.max_images} images per prompt are allowed "
                f"(--limit-mm-per-prompt); this prompt has {len(parts)}.",
                param="messages",
            )
        images = []
        for param, url in parts:
            if url.startswith(("http://", "https://")):
                raise InvalidRequestError(
                    "Image URLs are not fetched by this engine (no --allowed-media-domains); "
                    "send the image inline as a data URL (data:image/png;base64,...).",
                    param=param,
                )
            try:
                images.append(decode_data_url(url, param))
            except ImageError as exc:
                raise InvalidRequestError(exc.message, param=exc.param) from None
        return images

    def attach(
        self, token_ids: list[int], images: list[Any], options: dict[str, Any] | None = None
    ) -> tuple[list[int], list[ImageInput]]:
        """The rendered prompt with each image's placeholder expanded, and the images.
        ``options`` (a request's ``mm_processor_kwargs``) are checked by a model that reads
        them even without an image, and ignored by any other when there is none (vLLM's)."""
        try:
            if not images:
                check = getattr(self.model, "pixel_bounds", None)
                if options and check is not None:
                    check(options)
                return token_ids, []
            return attach_images(token_ids, images, self.model.image_processor, self.model, options)
        except ImageError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None
