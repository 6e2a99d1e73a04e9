"""Workloads for the benchmarks: what each request asks for.

Four sources, each deterministic for a given seed:

* :func:`synthetic` — random token ids with prompt and output lengths drawn uniformly from
  ranges (the standard engine workload: 256 requests, prompts 16-600, outputs 16-256);
* :func:`sharegpt` — a ShareGPT-format JSON file (first human turn as the prompt, the reply's
  length as the output budget);
* :func:`shared_prefix` — groups of requests that share a long common prefix (the prefix-cache
  workload);
* :func:`random_images` — chat requests with random pictures as data-URL image parts beside a
  text of random words (the vision workload; sent to ``/v1/chat/completions``).

Prompts are token ids when the lengths must be exact (sent to ``/v1/completions``, which
accepts token-id prompts), text otherwise.
"""

from __future__ import annotations

import base64
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

# Token ids safely inside any Llama-family vocabulary and away from special tokens.
TOKEN_ID_RANGE = (1000, 30000)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt (token ids or text) and output length.

    With ``images`` (data URLs) the request is a chat message: the images, then the prompt as
    its text; ``prompt_len`` is then the text's word count (the server's usage gives the real
    count, image tokens included)."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int
    images: tuple[str, ...] = ()


def synthetic(
    num_requests: int = 256,
    prompt_len: tuple[int, int] = (16, 600),
    output_len: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> list[BenchRequest]:
    """Random token-id prompts with uniformly drawn lengths (inclusive ranges)."""
    rng = random.Random(seed)
    lo, hi = TOKEN_ID_RANGE
    out = []
    for _ in range(num_requests):
        n_in = rng.randint(*prompt_len)
        n_out = rng.randint(*output_len)
        out.append(BenchRequest([rng.randint(lo, hi) for _ in range(n_in)], n_in, n_out))
    return out


def shared_prefix(
    num_groups: int = 4,
    requests_per_group: int = 8,
    prefix_len: int = 512,
    suffix_len: int = 32,
    output_len: int = 16,
    seed: int = 0,
) -> list[BenchRequest]:
    """Groups sharing a ``prefix_len``-token prefix; requests are interleaved across groups."""
    rng = random.Random(seed)
    lo, hi = TOKEN_ID_RANGE
    prefixes = [[rng.randint(lo, hi) for _ in range(prefix_len)] for _ in range(num_groups)]
    out = []
    for _ in range(requests_per_group):
        for prefix in prefixes:
            suffix = [rng.randint(lo, hi) for _ in range(suffix_len)]
            out.append(BenchRequest(prefix + suffix, prefix_len + suffix_len, output_len))
    return out


# Everyday words for the vision workload's texts (each about one token in Llama vocabularies).
_WORDS = (
    "the a of and to in is it that for on with as this was at by from be are or an have not "
    "what which their when there can all more one about would has will other time some these "
    "picture colour shape light left right top bottom middle corner small large bright dark"
).split()


def random_images(
    num_requests: int = 64,
    images_per_request: int = 1,
    image_size: tuple[int, int] = (224, 224),
    prompt_len: tuple[int, int] = (16, 64),
    output_len: tuple[int, int] = (16, 128),
    seed: int = 0,
) -> list[BenchRequest]:
    """Chat requests with ``images_per_request`` random PNG pictures each, width and height each
    drawn from ``image_size`` (inclusive), and a text of ``prompt_len`` random words.

    The texts and output lengths come from their own random stream, so the same seed gives the
    same texts whatever ``images_per_request`` is: ``images_per_request=0`` is the text-only
    baseline of the same workload. A picture is a coarse grid of random colours scaled up, so it
    compresses about as a photograph does rather than as noise."""
    if images_per_request < 0:
        raise ValueError("images_per_request must be >= 0")
    if not 1 <= image_size[0] <= image_size[1]:
        raise ValueError("image_size must be 1 <= MIN <= MAX")
    texts = random.Random(seed)
    pixels = random.Random(seed + 1_000_003)
    out = []
    for _ in range(num_requests):
        n_words = texts.randint(*prompt_len)
        words = " ".join(texts.choice(_WORDS) for _ in range(n_words))
        prompt = f"Describe this picture. {words}"
        n_out = texts.randint(*output_len)
        images = tuple(
            _png_data_url(pixels, pixels.randint(*image_size), pixels.randint(*image_size))
            for _ in range(images_per_request)
        )
        out.append(BenchRequest(prompt, len(prompt.split()), n_out, images))
    return out


def _png_data_url(rng: random.Random, width: int, height: int) -> str:
    from PIL import Image

    grid = Image.frombytes("RGB", (8, 8), bytes(rng.randrange(256) for _ in range(8 * 8 * 3)))
    picture = grid.resize((width, height), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def sharegpt(
    path: str | Path,
    num_requests: int,
    seed: int = 0,
    max_output_len: int = 1024,
    chars_per_token: float = 4.0,
) -> list[BenchRequest]:
    """Sample conversations from a ShareGPT JSON file (lengths estimated from characters)."""
    data = json.loads(Path(path).read_text())
    pairs: list[tuple[str, str]] = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        prompt = first.get("value") or first.get("content") or ""
        reply = second.get("value") or second.get("content") or ""
        if prompt and reply:
            pairs.append((prompt, reply))
    if not pairs:
        raise ValueError(f"{path}: no conversations with a prompt and a reply")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out = []
    for prompt, reply in pairs[:num_requests]:
        n_in = max(1, round(len(prompt) / chars_per_token))
        n_out = max(1, min(max_output_len, round(len(reply) / chars_per_token)))
        out.append(BenchRequest(prompt, n_in, n_out))
    return out


def arrival_gaps(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Seconds to wait before each request: Poisson (burstiness 1) or gamma arrivals.

    The mean gap is ``1 / request_rate`` whatever the burstiness; burstiness below 1 makes
    arrivals burstier, above 1 more regular. An infinite rate sends everything at once.
    """
    if request_rate <= 0:
        raise ValueError("request_rate must be > 0")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num_requests)]
