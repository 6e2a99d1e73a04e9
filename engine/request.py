"""Per-request state shared by the scheduler, the KV cache manager and the engine loop."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from engine.tenancy import DEFAULT_TENANT, TenantTag

if TYPE_CHECKING:
    from collections.abc import Sequence

    from engine.lora import LoRARequest
    from engine.multimodal import ImageInput
    from engine.structured_output import GrammarState


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status after SWAPPED is final."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2  # preempted with its KV copied to the CPU pool; waits to be swapped back in
    FINISHED_STOPPED = 3  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the context limit
    FINISHED_ABORTED = 5  # client gone, or aborted by the engine


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated.

    ``all_token_ids`` is prompt + output, kept as one list (appended to, never rebuilt) so
    block hashing and recompute after preemption read it without copying. Only the scheduler
    mutates ``status``, ``num_computed_tokens``, ``block_ids`` and the output; the engine loop
    reads them. ``block_ids`` is the request's block table (absolute position ``p`` lives in
    slot ``block_ids[p // block_size] * block_size + p % block_size``).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "arrival_time",
        "priority",
        "tenant",
        "cache_salt",
        "lora_request",
        "all_token_ids",
        "output_token_ids",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "stop_reason",
        "block_ids",
        "block_hashes",
        "num_preemptions",
        "first_scheduled_time",
        "first_token_time",
        "finished_time",
        "grammar",
        "spec_token_ids",
        "num_output_placeholders",
        "mm_inputs",
        "mrope_positions",
        "mrope_delta",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        tenant: TenantTag | None = None,
        mm_inputs: Sequence[ImageInput] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # vLLM's: lower is served first (within a priority class)
        self.tenant = DEFAULT_TENANT if tenant is None else tenant
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # None: the base model
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens hit in the prefix cache at first schedule
        self.stop_reason: int | str | None = None
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hash of each full block of all_token_ids
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # monotonic
        self.first_token_time: float | None = None  # monotonic, set by the engine loop
        self.finished_time: float | None = None  # monotonic
        # Structured outputs: this sequence's grammar matcher (engine thread only), or None.
        self.grammar: GrammarState | None = None
        # Speculative decoding: this step's guesses of the next tokens (engine-proposed, the
        # scheduler may shorten them; never part of all_token_ids until verified).
        self.spec_token_ids: list[int] = []
        # Asynchronous scheduling: tokens sampled by a launched step and not yet read (their
        # positions already count in num_computed_tokens). Always 0 in the synchronous engine.
        self.num_output_placeholders = 0
        # Images in the prompt (engine/multimodal.py): their placeholder runs and hashes.
        self.mm_inputs: tuple[ImageInput, ...] = tuple(mm_inputs)
        # M-RoPE (Qwen2-VL images): the prompt's (temporal, height, width) positions, computed
        # once here; a later token's position is its index + mrope_delta (engine/multimodal.py).
        self.mrope_positions: list[list[int]] | None = None
        self.mrope_delta = 0
        if any(image.grid is not None for image in self.mm_inputs):
            from engine.multimodal import mrope_positions

            self.mrope_positions, self.mrope_delta = mrope_positions(
                len(prompt_token_ids), self.mm_inputs
            )

    def positions(self, start: int, end: int) -> tuple[list[int], list[list[int]] | None]:
        """Positions of tokens ``[start, end)``: one per token, and, where M-RoPE gives some
        of them three different numbers (an image's tokens), the three rows; else None."""
        rows = self.mrope_positions
        if rows is None:
            return list(range(start, end)), None
        delta, prompt = self.mrope_delta, len(rows[0])
        tail = range(max(start, prompt) + delta, end + delta)
        if start >= prompt:
            return list(tail), None
        three = [[*row[start:end], *tail] for row in rows]
        return three[0], (None if three[0] == three[1] == three[2] else three)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past ``num_output_tokens`` (a finished request whose stop string
        ended inside a step that verified several tokens)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.SWAPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason ("stop" | "length" | "abort"), None while unfinished."""
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
