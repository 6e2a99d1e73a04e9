"""The gateway-engine contract: everything both ends of the engine hop must agree on, once.

The gateway (``portico serve``) sends each request to a local engine (``portico engine``) as
OpenAI-compatible HTTP plus the ``x-portico-*`` headers below, which it builds itself from the
authenticated principal (a client's own ``x-portico-*`` headers never travel). Both sides
import this module and nothing else of each other for the hop, so no name, bound or default
is written twice. It imports only the standard library and :mod:`portico.errors`: the gateway
loads it without torch.

What it holds:

- the header names and their parsing: the tenant tag (:func:`tenant_from_headers`) and the
  shared prefix (:func:`shared_prefix_of`, :func:`shared_prefix_header`);
- the bounds both sides check (tenant name, weight, running cap, cache salt length);
- the block hash (:func:`iter_prefix_block_hashes`): the engine's prefix cache and the
  gateway's prefix index hash the same token ids under the same salt to the same bytes;
- the fair scheduler's default step budgets, which the gateway's wait estimate models;
- the prompt positions one image fills in a vision model (:func:`tokens_per_image`, and for
  Qwen2-VL, whose count follows the picture's size, :func:`qwen2_vl_image_tokens`), which the
  engine expands and the gateway counts;
- the carried prompt (:func:`prompt_ids_field`, :func:`carried_prompt_ids`): the token ids the
  gateway already rendered and encoded for admission travel in the body, so the engine does
  not render and encode the same prompt again.

Tenant headers (absent: the tenant ``default`` with the defaults below):

- ``x-portico-tenant``: the tenant id (at most 200 characters)
- ``x-portico-tenant-weight``: the plan's weight, a positive number (default 1.0)
- ``x-portico-priority-class``: ``interactive`` or ``batch`` (default ``interactive``)
- ``x-portico-kv-share``: the most of the KV cache the tenant may hold, in (0, 1] (default 1.0)
- ``x-portico-max-running``: the most sequences the tenant may run at once on this engine, a
  whole number >= 0 (default 0: no cap of its own; the fair policy still takes slots back from
  a tenant over its share while others wait, see docs/internals.md "Slot share")
- ``x-portico-cache-shared-prefix: <characters>;<salt>``: the first ``characters`` characters
  of the first message's text (chat) or of the prompt (completions) are a prefix shared in the
  prefix cache under ``salt`` (engine/server/shared_prefix.py turns it into tokens).

Carried prompt: the gateway appends ``"portico_prompt_token_ids":[...]`` as the last key of the
body (JSON's last duplicate key wins, so a client's own key of that name is overridden) and
sends ``x-portico-prompt-token-ids: <fingerprint>``, its tokenizer's
:func:`tokenizer_fingerprint` (the chat template and the vocabulary size). The engine reads the
field only with that header, which a client can never send through the gateway, and only when
the fingerprint is its own tokenizer's; otherwise the field is ignored and the engine renders
and encodes as usual. The gateway carries ids only where they are certainly the
engine's: the served model's own tokenizer, a chat of plain text messages (no tools, content
parts, images or shared prefix) or a completion with one text prompt. A header alone would be
a poor carrier for an 8k-token prompt.

Not carried (yet): the prefix router's block hashes. They are cheap next to the rendering, and
the engine must hash its own blocks anyway to trust its cache; carrying them would mean
trusting the gateway's salt and block size to match, for little gain.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from portico.errors import InvalidRequestError, ParameterError

TENANT_HEADER = "x-portico-tenant"
WEIGHT_HEADER = "x-portico-tenant-weight"
PRIORITY_CLASS_HEADER = "x-portico-priority-class"
KV_SHARE_HEADER = "x-portico-kv-share"
MAX_RUNNING_HEADER = "x-portico-max-running"
ENGINE_HOP_HEADERS = (
    TENANT_HEADER,
    WEIGHT_HEADER,
    PRIORITY_CLASS_HEADER,
    KV_SHARE_HEADER,
    MAX_RUNNING_HEADER,
)
SHARED_PREFIX_HEADER = "x-portico-cache-shared-prefix"
# the gateway set PROMPT_IDS_FIELD; the value: its tokenizer's fingerprint (tokenizer_fingerprint)
PROMPT_IDS_HEADER = "x-portico-prompt-token-ids"
PROMPT_IDS_FIELD = "portico_prompt_token_ids"
MAX_CARRIED_PROMPT_TOKENS = 1 << 20  # beyond any engine's max_model_len: a bug, not a prompt

PRIORITY_CLASSES = ("interactive", "batch")  # served in this order
MAX_TENANT_LEN = 200
MAX_WEIGHT = 1e6  # a weight beyond this is a typo, and it would make the counters meaningless
MAX_RUNNING = 1_000_000  # a cap beyond any engine's --max-num-seqs is a typo
MAX_CACHE_SALT_CHARS = 1024  # a request's cache_salt, and a shared prefix's salt

# The fair scheduler's default step budgets (engine --fair-contended-prefill-tokens and
# --fair-short-prefill-tokens): the most prefill one step carries while two or more tenants
# have work, and the prompt size under which a tenant with nothing waiting gets a step of its
# own. The gateway's wait estimate (gateway/fleet/replica_load.py) models these defaults.
FAIR_CONTENDED_PREFILL_TOKENS = 192
FAIR_SHORT_PREFILL_TOKENS = 256


@dataclass(frozen=True, slots=True)
class TenantTag:
    """A request's tenant as the scheduler sees it: name, plan weight, class, KV share and cap.

    ``weight`` > 0 scales the tenant's fair share (2.0 gets twice the tokens of 1.0 when
    both are backlogged); ``priority_class`` is ``interactive`` (served first) or ``batch``;
    ``kv_share`` in (0, 1] caps the fraction of KV blocks the tenant's requests may hold;
    ``max_running`` > 0 caps how many of its requests run at once (0: no cap of its own).
    Values are validated by :func:`tenant_from_headers`; constructing one directly trusts them.
    """

    name: str = "default"
    weight: float = 1.0
    priority_class: str = "interactive"
    kv_share: float = 1.0
    max_running: int = 0

    @property
    def class_rank(self) -> int:
        """0 for interactive, 1 for batch: lower is served first."""
        return 1 if self.priority_class == "batch" else 0


DEFAULT_TENANT = TenantTag()


def tenant_from_headers(headers: Mapping[str, str]) -> TenantTag:
    """The tenant tag the engine-hop headers describe; ParameterError (a 400) on a bad value.

    ``headers`` must look names up case-insensitively if the caller's names may vary in
    case (Starlette's ``Headers`` does); absent headers take the defaults.
    """
    name = headers.get(TENANT_HEADER)
    if name is None:
        name = DEFAULT_TENANT.name
    elif not name or len(name) > MAX_TENANT_LEN or not name.isprintable():
        raise ParameterError(
            TENANT_HEADER,
            f"{TENANT_HEADER} must be 1 to {MAX_TENANT_LEN} printable characters",
        )
    weight = _number(headers, WEIGHT_HEADER, DEFAULT_TENANT.weight)
    if not 0 < weight <= MAX_WEIGHT:
        raise ParameterError(
            WEIGHT_HEADER, f"{WEIGHT_HEADER} must be a number in (0, {MAX_WEIGHT:g}], got {weight}"
        )
    kv_share = _number(headers, KV_SHARE_HEADER, DEFAULT_TENANT.kv_share)
    if not 0 < kv_share <= 1:
        raise ParameterError(
            KV_SHARE_HEADER, f"{KV_SHARE_HEADER} must be a number in (0, 1], got {kv_share}"
        )
    priority_class = headers.get(PRIORITY_CLASS_HEADER, DEFAULT_TENANT.priority_class).strip()
    if priority_class not in PRIORITY_CLASSES:
        raise ParameterError(
            PRIORITY_CLASS_HEADER,
            f"{PRIORITY_CLASS_HEADER} must be one of {', '.join(PRIORITY_CLASSES)}, "
            f"got {priority_class!r}",
        )
    max_running = _whole_number(headers, MAX_RUNNING_HEADER)
    tag = TenantTag(name, weight, priority_class, kv_share, max_running)
    return DEFAULT_TENANT if tag == DEFAULT_TENANT else tag


def _whole_number(headers: Mapping[str, str], header: str) -> int:
    text = headers.get(header)
    if text is None:
        return 0
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_RUNNING:
        raise ParameterError(
            header, f"{header} must be a whole number in [0, {MAX_RUNNING}], got {text!r}"
        )
    return int(text)


def _number(headers: Mapping[str, str], header: str, default: float) -> float:
    text = headers.get(header)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ParameterError(header, f"{header} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ParameterError(header, f"{header} must be a finite number, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """``num_chars`` leading characters of the request's text, cached under ``salt``."""

    num_chars: int
    salt: str


def shared_prefix_header(num_chars: int, salt: str) -> str:
    """The value of :data:`SHARED_PREFIX_HEADER` that :func:`shared_prefix_of` reads back."""
    return f"{num_chars};{salt}"


def shared_prefix_of(headers: Mapping[str, str]) -> SharedPrefix | None:
    """The declared shared prefix, None without the header; a 400 naming it when malformed
    (only the gateway sets it: a bad one is a bug to be loud about)."""
    value = headers.get(SHARED_PREFIX_HEADER)
    if value is None:
        return None
    count, sep, salt = value.partition(";")
    if (
        not sep
        or not count.isdigit()
        or int(count) < 1
        or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS
    ):
        raise InvalidRequestError(
            f"{SHARED_PREFIX_HEADER} must be '<characters>;<salt>' (a positive count, a salt "
            f"of 1 to {MAX_CACHE_SALT_CHARS} characters).",
            param=SHARED_PREFIX_HEADER,
        )
    return SharedPrefix(int(count), salt)


_SALT_TAG = b"cache_salt\x00"  # domain tag: salt bytes can never read as token ids
_LORA_TAG = b"lora\x00"  # the adapter's KV differs from the base model's for equal tokens
# A salt whose leading tokens are shared (with_shared_prefix): own salt, mark, count, shared salt.
_SHARED_MARK = "\x00shared-prefix\x00"


def with_shared_prefix(salt: str | None, shared_salt: str, num_tokens: int) -> str:
    """The cache salt of a request whose first ``num_tokens`` prompt tokens are a prefix
    shared by everyone holding ``shared_salt`` (a plan's common system prompt, say).

    The full blocks inside that prefix are hashed under ``shared_salt``; the first block past
    it brings in ``salt`` (the tenant's own), and every later block chains from it, so only the
    declared prefix is shared. Anything appended to the result later (a per-request salt)
    lands in the shared salt and so makes the whole request unique, never wider.
    """
    return f"{salt or ''}{_SHARED_MARK}{max(0, num_tokens)}\x00{shared_salt}"


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """SHA-256 of (parent hash, this block's token ids, extra keys): equal prefixes, equal hash.

    The parent is a fixed 32 bytes and the tokens a fixed ``block_size`` * 8 bytes, so the
    ``extra`` keys (domain-tagged, e.g. the cache salt) cannot be confused with either.
    """
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def block_extra(
    i: int, salt: str | None, num_shared: int, shared_salt: str, lora_id: int | None
) -> bytes:
    """The extra keys of full block ``i``: the salt where it starts, the adapter on block 0."""
    extra = b""
    if i == 0 and num_shared:
        extra = _SALT_TAG + shared_salt.encode()
    elif i == num_shared and salt is not None:  # the request's own salt starts here
        extra = _SALT_TAG + salt.encode()
    if i == 0 and lora_id is not None:
        extra += _LORA_TAG + str(lora_id).encode()
    return extra


def split_salt(cache_salt: str | None, block_size: int) -> tuple[str | None, int, str]:
    """(own salt, number of shared full blocks, shared salt) of a request's cache salt (None:
    unsalted), as :func:`block_extra` takes them."""
    if cache_salt is None:
        return None, 0, ""
    own, mark, rest = cache_salt.partition(_SHARED_MARK)
    if not mark:
        return cache_salt, 0, ""
    count, _, shared = rest.partition("\x00")
    return own, int(count) // block_size if count.isdigit() else 0, shared


def prefix_block_hashes(
    root_hash: bytes,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora_int_id: int | None = None,
) -> list[bytes]:
    """The hashes of the full blocks of ``token_ids`` exactly as the engine's KV cache manager
    with ``root_hash`` computes them for a request with this salt and adapter (a router outside
    the engine matches them against the engine's block events: engine/kv_events.py)."""
    return list(iter_prefix_block_hashes(root_hash, token_ids, block_size, cache_salt, lora_int_id))


def iter_prefix_block_hashes(
    root_hash: bytes,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora_int_id: int | None = None,
) -> Iterator[bytes]:
    """:func:`prefix_block_hashes` one block at a time: a caller matching a prefix stops
    hashing at its first miss."""
    salt, num_shared, shared_salt = split_salt(cache_salt, block_size)
    parent = root_hash
    for i in range(len(token_ids) // block_size):
        extra = block_extra(i, salt, num_shared, shared_salt, lora_int_id)
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        yield parent


# -- images ----------------------------------------------------------------------------------

# Vision-language architectures the engine serves (engine/models/llava.py, qwen2_vl.py,
# qwen2_5_vl.py); the Qwen ones count an image's tokens by its size (qwen2_vl_image_tokens).
QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", *QWEN_VL_ARCHITECTURES)
# Qwen2-VL's resize bounds (pixels of the resized picture): transformers' defaults, and the most
# a request's mm_processor_kwargs.max_pixels may ask for (Qwen2-VL's own preprocessor_config).
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 28 * 28 * 1280
QWEN2_VL_MAX_PIXELS_LIMIT = 28 * 28 * 16384
QWEN2_VL_MAX_ASPECT = 200  # longer side / shorter side, as transformers refuses beyond it


def tokens_per_image(raw: Mapping[str, Any]) -> int | None:
    """Prompt positions one image fills in a LLaVA model (its config.json): the vision
    tower's rows (its patches, plus a CLS row for CLIP; SigLIP has none), less the first row
    under the "default" feature strategy (transformers drops it whichever the tower); None for
    a model that takes no images. The engine (engine/models/llava.py) and the gateway's prompt
    counter (its reservations and usage) both read it here, so an image costs the same count
    on both sides of the hop."""
    architectures = raw.get("architectures") or []
    if not architectures or architectures[0] != VISION_ARCHITECTURES[0]:
        return None
    vision = raw.get("vision_config") or {}
    siglip = vision.get("model_type") == "siglip_vision_model"
    side = int(vision.get("image_size", 224)) // int(vision.get("patch_size", 16 if siglip else 32))
    dropped = int(raw.get("vision_feature_select_strategy", "default") == "default")
    return side * side + int(not siglip) - dropped


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's resize target (transformers' ``smart_resize``): each side a multiple of
    ``factor`` (patch size x merge size), the area within ``[min_pixels, max_pixels]``, the
    aspect ratio kept as closely as those allow. ValueError for an aspect ratio over 200."""
    if max(height, width) > QWEN2_VL_MAX_ASPECT * min(height, width):
        raise ValueError(f"the image's aspect ratio is over {QWEN2_VL_MAX_ASPECT}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen2_vl_image_grid(
    raw: Mapping[str, Any], height: int, width: int, min_pixels: int, max_pixels: int
) -> tuple[int, int, int]:
    """The patch grid ``(t, h, w)`` of one picture in a Qwen2-VL model (its config.json): the
    picture resized by :func:`smart_resize`, cut into ``patch_size`` squares, one temporal
    patch (a still image is its own two frames)."""
    vision = raw.get("vision_config") or {}
    patch = int(vision.get("patch_size", 14))
    merge = int(vision.get("spatial_merge_size", 2))
    h, w = smart_resize(height, width, patch * merge, min_pixels, max_pixels)
    return 1, h // patch, w // patch


def qwen2_vl_image_tokens(
    raw: Mapping[str, Any], height: int, width: int, min_pixels: int, max_pixels: int
) -> int:
    """Prompt positions one ``width`` x ``height`` picture fills in a Qwen2-VL model: its patch
    grid (:func:`qwen2_vl_image_grid`) over the merger's ``spatial_merge_size`` squared patches per
    token. The engine's expansion follows the same grid (engine/models/qwen2_vl.py)."""
    t, h, w = qwen2_vl_image_grid(raw, height, width, min_pixels, max_pixels)
    merge = int((raw.get("vision_config") or {}).get("spatial_merge_size", 2))
    return t * h * w // (merge * merge)


def pixel_options_error(options: Any) -> tuple[str, str] | None:
    """``(param, message)`` for a request's ``mm_processor_kwargs`` whose ``min_pixels`` or
    ``max_pixels`` Qwen2-VL could not use (not a whole number >= 1, over
    :data:`QWEN2_VL_MAX_PIXELS_LIMIT`, min over max); None when they are fine. The gateway
    checks this before admission, the engine again when it resizes (engine/models/qwen2_vl.py),
    so a bad value is the same 400 on both sides of the hop. Other keys are not judged here."""
    if not isinstance(options, Mapping):
        return "mm_processor_kwargs", "must be an object"
    for key in ("min_pixels", "max_pixels"):
        value = options.get(key)
        if value is None:
            continue
        param = f"mm_processor_kwargs.{key}"
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return param, "must be a whole number of pixels >= 1"
        if value > QWEN2_VL_MAX_PIXELS_LIMIT:
            return param, f"must be at most {QWEN2_VL_MAX_PIXELS_LIMIT}"
    low, high = options.get("min_pixels"), options.get("max_pixels")
    if low is not None and high is not None and low > high:
        return "mm_processor_kwargs", "min_pixels must not exceed max_pixels"
    return None


def prompt_ids_field(token_ids: Sequence[int]) -> bytes:
    """The body member the gateway appends: ``"portico_prompt_token_ids":[1,2,...]``."""
    return b'"%s":[%s]' % (PROMPT_IDS_FIELD.encode(), ",".join(map(str, token_ids)).encode())


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What must be equal for the gateway's prompt ids to be the engine's own: the chat
    template and the vocabulary size (added tokens included), hashed to 16 hex digits."""
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else ""
    data = f"{len(tokenizer)}\x00{text}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:16]


def carried_prompt_ids(
    headers: Mapping[str, str], value: Any, fingerprint: str
) -> list[int] | None:
    """The prompt token ids the gateway carried, or None where it carried none (a client's own
    field without the gateway's header is ignored) or carried another tokenizer's (the header's
    fingerprint is not ``fingerprint``, the engine's: it renders and encodes itself). Raises
    :class:`InvalidRequestError` naming the field for ids that are not a non-empty list of whole
    numbers within the bound; the engine checks them against its vocabulary."""
    if headers.get(PROMPT_IDS_HEADER) != fingerprint:
        return None
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_CARRIED_PROMPT_TOKENS
        or not all(type(t) is int for t in value)
    ):
        raise InvalidRequestError(
            f"{PROMPT_IDS_FIELD} must be a list of 1 to {MAX_CARRIED_PROMPT_TOKENS} token ids.",
            param=PROMPT_IDS_FIELD,
        )
    return value
