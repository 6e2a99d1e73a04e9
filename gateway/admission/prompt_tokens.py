"""Prompt token counts for admission, with the served model's own tokenizer.

One tokenizer per local model, loaded once at start-up (transformers ``AutoTokenizer`` from the
model folder or GGUF file); chat requests are rendered with the model's chat template first,
exactly as the engine renders them. Counting in-process costs tens of microseconds for a short
prompt, an HTTP hop to the engine's ``/tokenize`` costs a round trip plus the engine's own
parse, so the gateway counts itself. Models without a local tokenizer (remote upstreams, custom
engine commands) get an estimate of one token per four characters. Tool definitions are part of
the prompt the engine renders (a listing of each function's JSON schema), so their JSON text is
counted too, whether or not the model's template shows them.

Image parts count as the engine counts them: a vision model's template places one image token
per image, which the engine expands to the model's tokens per image (its config.json,
:func:`load_image_tokens`); where that number is unknown (a remote model) an image is
estimated at :data:`IMAGE_TOKEN_ESTIMATE` tokens, settled with the real usage afterwards.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.body.fields import RequestFields, prompt_text
from gateway.body.image_parts import image_size, image_urls, num_images, template_messages

log = logging.getLogger("portico.gateway.tokens")
# An image whose model's token count is unknown: OpenAI's count for a high-detail 1024 x 1024
# image (a reservation; the upstream's usage settles it).
IMAGE_TOKEN_ESTIMATE = 765


def load_tokenizer(model: str) -> Any | None:
    """The tokenizer of a model spec (alias, HF folder or GGUF path), or None if unavailable."""
    try:
        from transformers import AutoTokenizer

        from portico import registry

        source = registry.resolve(model)
        folder = registry.tokenizer_folder(source)  # written by `portico models pull`
        if folder is not None:
            return AutoTokenizer.from_pretrained(str(folder))
        if source.format == "gguf":
            return AutoTokenizer.from_pretrained(
                str(source.path.parent), gguf_file=source.path.name
            )
        return AutoTokenizer.from_pretrained(str(source.path))
    except Exception as exc:  # any failure means: estimate instead
        log.warning("no tokenizer for %s (%s); prompt tokens will be estimated", model, exc)
        return None


@dataclass(frozen=True)
class SizedImageTokens:
    """A Qwen2-VL or Qwen2.5-VL model's image count, which follows each picture's size: the
    contract's rule (:func:`portico.contract.qwen2_vl_image_tokens`) over the folder's pixel
    bounds, or a request's valid ``mm_processor_kwargs`` ones. A picture whose size the
    gateway cannot read (an http URL) is reserved at the most ``max_pixels`` allows."""

    config: Mapping[str, Any]  # the folder's config.json
    min_pixels: int
    max_pixels: int

    def count(self, url: str, options: Any) -> int:
        from portico.contract import pixel_options_error, qwen2_vl_image_tokens

        low, high = self.min_pixels, self.max_pixels
        if isinstance(options, Mapping) and pixel_options_error(options) is None:
            low = int(options.get("min_pixels") or low)
            high = int(options.get("max_pixels") or high)
        size = image_size(url)
        if size is None or low > high:
            return max(1, high // (28 * 28))
        try:
            return qwen2_vl_image_tokens(self.config, size[1], size[0], low, high)
        except ValueError:  # an aspect ratio the engine refuses with its own 400
            return 1


def load_image_tokens(model: str) -> int | SizedImageTokens | None:
    """Prompt tokens one image fills in a local vision model (a LLaVA folder's config.json),
    the size-dependent rule of a Qwen2-VL or Qwen2.5-VL folder, or None (a text model, or a
    model whose files cannot be read)."""
    try:
        from portico import registry
        from portico.contract import (
            QWEN2_VL_MAX_PIXELS,
            QWEN2_VL_MIN_PIXELS,
            QWEN_VL_ARCHITECTURES,
            tokens_per_image,
        )

        source = registry.resolve(model)
        config = source.path / "config.json"
        if source.format != "hf" or not config.is_file():
            return None
        raw = json.loads(config.read_text())
        if (raw.get("architectures") or [None])[0] in QWEN_VL_ARCHITECTURES:
            pre = source.path / "preprocessor_config.json"
            pre_raw = json.loads(pre.read_text()) if pre.is_file() else {}
            # transformers 5 writes size.shortest_edge/longest_edge; Qwen's own folders write
            # min_pixels/max_pixels at the top, which transformers maps onto them.
            size = pre_raw.get("size") or {}
            low = size.get("shortest_edge") or pre_raw.get("min_pixels")
            high = size.get("longest_edge") or pre_raw.get("max_pixels")
            return SizedImageTokens(
                raw, int(low or QWEN2_VL_MIN_PIXELS), int(high or QWEN2_VL_MAX_PIXELS)
            )
        return tokens_per_image(raw)
    except Exception as exc:  # any failure means: estimate instead
        log.warning("no image token count for %s (%s)", model, exc)
        return None


class PromptCounter:
    """Counts prompt tokens per served model name; thread-compatible, no shared mutation.

    ``image_tokens``: served model name -> prompt tokens per image (vision models)."""

    def __init__(
        self,
        tokenizers: dict[str, Any],
        image_tokens: Mapping[str, int | SizedImageTokens] | None = None,
    ):
        self.tokenizers = tokenizers  # served model name -> tokenizer (absent: estimate)
        self.image_tokens = dict(image_tokens or {})

    def count(self, model: str, fields: RequestFields) -> int:
        tools = (
            (fields.body.get("tools") or fields.body.get("functions")) if fields.num_tools else []
        )
        tool_text = json.dumps(tools) if tools else ""
        images = num_images(fields.messages)
        image_total = self._image_tokens(model, fields, images)
        tok = self.tokenizers.get(model)
        if tok is not None and (not images or image_total is not None):
            try:
                # the template wrote one placeholder token per image; the engine expands it
                expansion = (image_total or images) - images
                return self._exact(tok, fields) + self._text_tokens(tok, tool_text) + expansion
            except Exception:  # a template that rejects these messages: the engine will say why
                pass
        estimate = (len(prompt_text(fields)) + len(tool_text)) // 4
        return max(1, estimate + (image_total or images * IMAGE_TOKEN_ESTIMATE))

    def _image_tokens(self, model: str, fields: RequestFields, images: int) -> int | None:
        """All the prompt positions the request's images fill on ``model``; None: unknown."""
        rule = self.image_tokens.get(model)
        if not images or rule is None:
            return None
        if isinstance(rule, SizedImageTokens):
            options = fields.body.get("mm_processor_kwargs")
            return sum(rule.count(url, options) for url in image_urls(fields.messages))
        return images * rule

    @staticmethod
    def _text_tokens(tok: Any, text: str) -> int:
        if not text:
            return 0
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            return len(backend.encode(text, add_special_tokens=False).ids)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _exact(tok: Any, fields: RequestFields) -> int:
        # The Rust tokenizer underneath a fast tokenizer skips transformers' per-call Python
        # work (BatchEncoding, argument checks): about half the cost for a short prompt.
        backend = getattr(tok, "backend_tokenizer", None)
        if fields.messages is not None:
            text = tok.apply_chat_template(
                template_messages(fields.messages), tokenize=False, add_generation_prompt=True
            )
            if backend is not None:
                ids = list(backend.encode(text, add_special_tokens=False).ids)
            else:
                ids = list(tok(text, add_special_tokens=False)["input_ids"])
            # kept for the prefix-aware router: the same rendering, the same encoding
            fields.chat_prompt_ids = (tok, fields.messages, ids)
            return len(ids)
        prompt = fields.prompt
        if isinstance(prompt, str):
            if backend is not None:
                text_ids = list(backend.encode(prompt).ids)
            else:
                text_ids = list(tok(prompt)["input_ids"])
            fields.text_prompt_ids = (tok, prompt, text_ids)  # carried to a local engine
            return len(text_ids)
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)  # already token ids
        total = 0
        for item in prompt or ():
            if isinstance(item, str):
                total += len(tok(item)["input_ids"])
            elif isinstance(item, list):
                total += len(item)
        return total
