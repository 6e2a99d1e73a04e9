"""What the gateway does with a prompt longer than the model's context: a per-model policy.

``refuse`` (the default) sends the request on and the engine answers 400
``context_length_exceeded``, as OpenAI does. ``truncate_left`` drops the oldest turns of a
conversation but keeps its system prompt(s) and the last turn (a text prompt or an embedding
input keeps its last tokens: vLLM's ``truncate_prompt_tokens``); ``truncate_middle`` keeps the
system prompt, the first turn and the latest turns, dropping from the middle (a text prompt
keeps its head and tail tokens). A request that was cut carries the response header
``x-portico-prompt-truncated`` saying how. The policy needs the model's context length
(``--max-model-len`` in the engine's args, else the model folder's config.json or the GGUF
file's ``context_length``).

The same context length makes an omitted ``max_tokens`` mean "as much as fits" (vLLM's
meaning) even when the plan's default cap is larger: :meth:`PromptFit.cap_max_tokens`.
What the engine generates beyond the reservation is charged when the request settles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from gateway.admission.prompt_tokens import PromptCounter
from gateway.body.fields import RequestFields
from portico.errors import InvalidRequestError

Policy = Literal["refuse", "truncate_left", "truncate_middle"]
HEADER = "x-portico-prompt-truncated"
# The gateway counts tool definitions as their JSON and templates as the tokenizer renders
# them without the engine's tool preamble: the engine's count can be higher. A cap is only
# sent with this much room (plus half the prompt) to spare.
COUNT_SLACK_TOKENS = 16


def context_length(model: str, args: list[str]) -> int | None:
    """``--max-model-len`` of the engine args, else ``max_position_embeddings`` of the model
    folder's config.json or the GGUF file's ``<arch>.context_length``; None when unknown."""
    for i, arg in enumerate(args):
        if arg == "--max-model-len" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--max-model-len="):
            return int(arg.split("=", 1)[1])
    try:
        from portico import registry

        source = registry.resolve(model)
        if source.format == "hf":
            value = json.loads((source.path / "config.json").read_text()).get(
                "max_position_embeddings"
            )
            return int(value) if value else None
        from engine.gguf_file import GGUFFile  # the engine's own default for a GGUF file

        meta = GGUFFile(source.path).metadata
        value = meta.get(f"{meta.get('general.architecture')}.context_length")
        return int(value) if value else None
    except (ValueError, OSError):
        return None


@dataclass(frozen=True)
class PromptFit:
    """One served model's context length and long-prompt policy."""

    max_model_len: int
    policy: Policy = "refuse"

    def cap_max_tokens(self, prompt_tokens: int, max_tokens: int) -> int | None:
        """The output cap to send when the gateway chose one (the client set none): the cap
        while it fits beside the prompt, else None: send none, and the engine generates as
        much as fits (it counts the prompt exactly; the gateway's count of tools and
        templates is close, not exact, so a cap cut here could still overflow by a little).
        """
        slack = prompt_tokens // 2 + COUNT_SLACK_TOKENS  # room for what the count may miss
        return max_tokens if prompt_tokens + max_tokens + slack <= self.max_model_len else None

    def check_room(self, fields: RequestFields, prompt_tokens: int) -> None:
        """A 400 ``context_length_exceeded`` (the engine's own words) when the client's
        ``max_tokens`` cannot fit beside the prompt: refused here, before admission, so a
        request that cannot run is never refused for quota nor charged. Called only with an
        exact count (the model's tokenizer, no tools): the engine would refuse it the same."""
        if fields.kind not in ("chat", "completion") or fields.max_tokens is None:
            return
        limit, asked = self.max_model_len, fields.max_tokens
        if prompt_tokens + asked <= limit:
            return
        what = "messages" if fields.kind == "chat" else "prompt"
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + asked} tokens ({prompt_tokens} in the {what}, {asked} in the "
            f"completion). Please reduce the length of the {what} or completion.",
            param=fields.max_tokens_name if prompt_tokens < limit else what,
            code="context_length_exceeded",
        )

    def apply(
        self, fields: RequestFields, prompt_tokens: int, counter: PromptCounter, model: str
    ) -> tuple[int, str | None]:
        """Cut the request in place when it does not fit and the policy says so: the new
        prompt token count and the header value saying what was cut (None: nothing)."""
        reserve = 1 if fields.kind == "embedding" else (fields.max_tokens or 1)
        budget = self.max_model_len - reserve
        if self.policy == "refuse" or prompt_tokens <= budget or budget < 1:
            return prompt_tokens, None
        if fields.kind == "chat" and fields.messages:
            return self._drop_turns(fields, prompt_tokens, counter, model, budget)
        if fields.kind == "embedding" or (
            fields.kind == "completion" and self.policy == "truncate_left"
        ):
            fields.body["truncate_prompt_tokens"] = budget  # the engine keeps the last ones
            fields.edited = True
            return budget, f"{self.policy}; kept_tokens={budget}"
        if fields.kind == "completion" and isinstance(fields.prompt, str):
            return self._cut_text_middle(fields, prompt_tokens, counter, model, budget)
        return prompt_tokens, None

    def _drop_turns(
        self,
        fields: RequestFields,
        prompt_tokens: int,
        counter: PromptCounter,
        model: str,
        budget: int,
    ) -> tuple[int, str | None]:
        messages: list[dict[str, Any]] = list(fields.messages or [])
        dropped = 0
        while prompt_tokens > budget:
            turns = [i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES]
            if len(turns) <= 1:  # only the last turn is left: nothing more may go
                break
            if self.policy == "truncate_left":
                victim = turns[0]
            else:  # the middle: keep the first turn and the latest ones
                if len(turns) <= 2:
                    break
                victim = turns[1]
            del messages[victim]
            # A tool turn without the assistant call it answers would be refused: drop it too.
            while victim < len(messages) - 1 and messages[victim].get("role") == "tool":
                del messages[victim]
                dropped += 1
            dropped += 1
            fields.messages = messages
            prompt_tokens = counter.count(model, fields)
        if not dropped:
            return prompt_tokens, None
        fields.body["messages"] = messages
        fields.edited = True
        return prompt_tokens, f"{self.policy}; dropped_messages={dropped}"

    def _cut_text_middle(
        self,
        fields: RequestFields,
        prompt_tokens: int,
        counter: PromptCounter,
        model: str,
        budget: int,
    ) -> tuple[int, str | None]:
        tokenizer = counter.tokenizers.get(model)
        if tokenizer is None:  # no tokenizer here: the engine refuses as before
            return prompt_tokens, None
        ids = list(tokenizer.encode(fields.prompt))
        head = budget // 2
        kept = ids[:head] + ids[len(ids) - (budget - head) :]
        fields.body["prompt"] = kept  # token ids: the engine runs exactly these
        fields.prompt = kept
        fields.edited = True
        return len(kept), f"truncate_middle; kept_tokens={len(kept)}"


SYSTEM_ROLES = ("system", "developer")
