"""Images in prompts: decoding, preprocessing, placeholder expansion, and content hashes.

A chat message's image part becomes an :class:`ImageInput`: the preprocessed pixels (exactly
what the model folder's transformers image processor makes of the picture), the run of
placeholder tokens it fills in the prompt (``offset``, ``length``: fixed for LLaVA, by the
picture's size for Qwen2-VL, whose images also carry their grid for M-RoPE,
:func:`mrope_positions`), and a hash of its pixels.
The scheduler and the KV cache manager see only token ids and that hash: image tokens' block
hashes take the image's hash (engine/kv_cache_manager.py), so the same picture at the same
place hits the prefix cache and two different pictures never share a block. The model runner
encodes an image in the step that first computes one of its tokens (engine/model_runner.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Image formats accepted in data URLs (Pillow's names); GIF: the first frame.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DEFAULT_MAX_IMAGES = 4  # per prompt, --limit-mm-per-prompt image=N
MAX_IMAGE_BYTES = 20 * 2**20  # one decoded data URL (OpenAI's own limit per image is 20 MB)
MAX_IMAGE_PIXELS = 64 * 2**20  # width * height: refuse decompression bombs before decoding
# Encoded images kept by the runner (EncoderCache): LLaVA-1.5-7B's rows of one image are
# 576 x 4096 bf16 values, 4.5 MiB, so 8 of them are 36 MiB beside the KV cache.
ENCODER_CACHE_IMAGES = 8


class ImageError(ValueError):
    """An image part that cannot be used; ``param`` names the field (OpenAI's error shape)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(eq=False)
class ImageInput:
    """One image of a prompt: its pixels, where its placeholder tokens are, its content hash.

    ``embeds`` is the model runner's: the encoded rows while the image's tokens are being
    prefilled (possibly over several chunked steps), dropped once they all are.
    """

    offset: int  # position of the first placeholder token in the prompt
    length: int  # placeholder tokens it fills (the model's tokens per image)
    content_hash: bytes  # sha256 of the preprocessed pixels (and their shape)
    pixel_values: torch.Tensor  # [C, H, W] (LLaVA) or [patches, values] (Qwen2-VL), float32
    embeds: torch.Tensor | None = field(default=None, repr=False)
    # Qwen2-VL: the merged grid (t, h, w) the image's tokens fill, for M-RoPE; None: LLaVA.
    grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


class EncoderCache:
    """Encoded image rows by (cache salt, image hash), the least recently used dropped first.

    The prefix cache already skips an image whose tokens all sit in cached full blocks; this
    keeps the vision tower from running again for one whose last block is not full (a short
    prompt) or was evicted. The salt is part of the key, so a tenant never gets (or times)
    another tenant's encoding. Rows are what a fresh encoding of the image alone returns, so
    a hit changes no bit. Not thread-safe (the runner's step only).
    """

    def __init__(self, capacity: int = ENCODER_CACHE_IMAGES) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[tuple[str | None, bytes], torch.Tensor] = OrderedDict()

    def get(self, salt: str | None, digest: bytes) -> torch.Tensor | None:
        rows = self._rows.get((salt, digest))
        if rows is not None:
            self._rows.move_to_end((salt, digest))
        return rows

    def put(self, salt: str | None, digest: bytes, rows: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        self._rows[(salt, digest)] = rows
        self._rows.move_to_end((salt, digest))
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)


def parse_limit_mm_per_prompt(spec: str | int | None) -> int:
    """``--limit-mm-per-prompt``: ``image=N`` (vLLM's syntax, a comma list of modality=N), a
    JSON object ``{"image": N}``, or a bare ``N``. Returns the image limit."""
    if spec is None or spec == "":
        return DEFAULT_MAX_IMAGES
    if isinstance(spec, int):
        return _check_limit(spec)
    text = spec.strip()
    if text.startswith("{"):
        import json

        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--limit-mm-per-prompt: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError('--limit-mm-per-prompt: expected an object like {"image": 4}')
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        pairs = [tuple(p.split("=", 1)) if "=" in p else ("image", p) for p in text.split(",")]  # type: ignore[misc]
    limit = DEFAULT_MAX_IMAGES
    for name, count in pairs:
        if name.strip() != "image":
            raise ValueError(f"--limit-mm-per-prompt: modality '{name.strip()}' is not served")
        if not count.strip().isdigit():
            raise ValueError(f"--limit-mm-per-prompt: image count '{count}' is not a number")
        limit = _check_limit(int(count))
    return limit


def _check_limit(value: int) -> int:
    if value < 0:
        raise ValueError("--limit-mm-per-prompt: the image count must be >= 0")
    return value


def decode_data_url(url: str, param: str, max_bytes: int = MAX_IMAGE_BYTES) -> Any:
    """A ``data:image/...;base64,...`` URL to an RGB Pillow image (a GIF's first frame).
    :class:`ImageError` naming ``param`` for anything else: another scheme, bad base64, not
    an image, a format outside :data:`IMAGE_FORMATS`, too many bytes or pixels."""
    from PIL import Image

    header, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma or ";base64" not in header:
        raise ImageError(param, "expected a data URL: data:image/png;base64,<base64 data>")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise ImageError(param, f"the image is larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(param, "the data URL's base64 payload is not valid base64") from None
    try:
        with Image.open(io.BytesIO(raw)) as image:
            if image.format not in IMAGE_FORMATS:
                raise ImageError(
                    param,
                    f"image format {image.format} is not supported ({', '.join(IMAGE_FORMATS)})",
                )
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ImageError(param, f"the image has more than {MAX_IMAGE_PIXELS} pixels")
            image.seek(0)  # a GIF's (or animated WebP's) first frame
            return image.convert("RGB")
    except ImageError:
        raise
    except Exception:  # Pillow raises many kinds for bytes that are not a picture
        raise ImageError(param, "the data URL does not hold a readable image") from None


def preprocess(images: Sequence[Any], image_processor: Any) -> torch.Tensor:
    """``[N, C, H, W]`` float32 pixels, as the model folder's image processor makes them."""
    out = image_processor(images=list(images), return_tensors="pt")
    return out["pixel_values"].to(torch.float32)


def hash_pixels(pixels: torch.Tensor, grid: tuple[int, int, int] | None = None) -> bytes:
    """SHA-256 of one preprocessed image (shape, grid and float32 bytes): equal pictures,
    equal hash, whatever file format or URL carried them."""
    data = pixels.detach().to(torch.float32).contiguous().cpu()
    shape = repr(tuple(data.shape)) if grid is None else repr((tuple(data.shape), grid))
    h = hashlib.sha256(shape.encode())
    h.update(data.numpy().tobytes())
    return h.digest()


def expand_placeholders(
    token_ids: Sequence[int],
    image_token_id: int,
    prepared: Sequence[tuple[torch.Tensor, int, tuple[int, int, int] | None]],
) -> tuple[list[int], list[ImageInput]]:
    """Repeat each image placeholder token as many times as its image fills (``prepared``:
    per image, in order, its pixels, its token count and its M-RoPE grid or None) and pair
    the runs with the images. ImageError when the prompt's placeholders and the images
    disagree in number (a template that dropped an image, or text that typed the placeholder
    itself)."""
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != len(prepared):
        raise ImageError(
            "messages",
            f"the prompt has {found} image placeholders for {len(prepared)} images "
            "(the image token must not appear in the text)",
        )
    out: list[int] = []
    images: list[ImageInput] = []
    for token in token_ids:
        if token != image_token_id:
            out.append(token)
            continue
        pixel, length, grid = prepared[len(images)]
        digest = hash_pixels(pixel) if grid is None else hash_pixels(pixel, grid)
        images.append(ImageInput(len(out), length, digest, pixel, grid=grid))
        out.extend([image_token_id] * length)
    return out, images


def mrope_positions(num_tokens: int, images: Sequence[ImageInput]) -> tuple[list[list[int]], int]:
    """A prompt's M-RoPE positions (engine/models/qwen2_vl.py): three rows (temporal, height,
    width) of ``num_tokens`` numbers, and the delta a generated token adds to its index. Text
    counts up by one in all three rows; an image starting at position ``p`` gives its cell
    (t, row, column) of its grid ``(p + t, p + row, p + column)``, and the text after it
    continues from ``p + max(h, w)`` (transformers' ``get_rope_index``)."""
    rows: list[list[int]] = [[], [], []]
    pos = cursor = 0
    for image in images:
        if image.grid is None:
            continue
        for row in rows:
            row.extend(range(pos, pos + image.offset - cursor))
        pos += image.offset - cursor
        t, h, w = image.grid
        rows[0].extend(pos + i for i in range(t) for _ in range(h * w))
        rows[1].extend(pos + i for _ in range(t) for i in range(h) for _ in range(w))
        rows[2].extend(pos + i for _ in range(t * h) for i in range(w))
        pos += max(h, w)
        cursor = image.end
    for row in rows:
        row.extend(range(pos, pos + num_tokens - cursor))
    top = max(max(row) for row in rows) if num_tokens else -1
    return rows, top + 1 - num_tokens


def block_image_keys(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """The image hashes of every image with a token in positions ``[start, end)``, in order:
    the extra keys of that KV block's hash."""
    return b"".join(
        b"image\x00" + image.content_hash
        for image in images
        if image.offset < end and image.end > start
    )


def attach_images(
    token_ids: Sequence[int],
    images: Sequence[Any],
    image_processor: Any,
    model: Any,
    options: dict[str, Any] | None = None,
) -> tuple[list[int], list[ImageInput]]:
    """A rendered prompt with one placeholder token per image, and its Pillow ``images`` in
    order, as the engine takes them: the placeholders expanded to each image's tokens, each
    image preprocessed and hashed. ``model`` is a vision model (engine/models/llava.py or
    qwen2_vl.py); ``options`` a request's ``mm_processor_kwargs`` (Qwen2-VL's pixel bounds)."""
    vision = model.vision
    prepare = getattr(model, "prepare_images", None)
    if prepare is not None:  # a size-dependent count (Qwen2-VL)
        made = prepare(images, options)
        prepared = [(p.pixel_values, p.num_tokens, p.grid) for p in made]
        return expand_placeholders(token_ids, vision.image_token_id, prepared)
    if options:
        raise ImageError("mm_processor_kwargs", "this model takes no image processor settings")
    pixels = preprocess(images, image_processor) if images else torch.empty(0)
    fixed = [(pixel, vision.num_image_tokens, None) for pixel in pixels]
    return expand_placeholders(token_ids, vision.image_token_id, fixed)
