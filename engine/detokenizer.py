"""Incremental detokenization and stop strings for one completion.

Text is decoded over a short window of token ids with two offsets, as vLLM's
``detokenize_incrementally`` does: ``prefix_offset`` .. ``read_offset`` is text already emitted
(decoded again only as context, so merges such as leading spaces come out right) and
``read_offset`` .. end is new. A window whose text ends in U+FFFD holds a multibyte character
cut between tokens; it is held back until a later token completes it, so no emitted text ever
contains half a character. The window starts on the last few prompt tokens for context.

Stop strings are searched only where a new match can start (the tail of the text the last token
could have completed), so a stop string split over several tokens is found. The stream shows
text minus the last ``len(longest stop) - 1`` characters until the completion finishes, so the
beginning of a stop string is never streamed before the rest of it arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens kept as decoding context (vLLM uses 5 before the read offset).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The text state of one completion: ``text`` so far, the stop string that ended it.

    Not thread-safe; one per completion. ``text`` never contains a broken UTF-8 character
    except when the completion finished on one (then the replacement character is kept).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids[-(_CONTEXT_TOKENS + 1) :])
        self._ids: list[int] = context
        self._prefix_offset = max(len(context) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(context)
        self.text = ""
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=self._skip_special))
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))

    def append(self, token_id: int, *, decode: bool = True, check_stop: bool = True) -> str | None:
        """Add one sampled token; return the stop string it completed, if any.

        ``decode=False`` records the token without adding its text (a stop token or EOS whose
        text is not wanted in the output). ``check_stop=False`` skips the stop-string search
        (before ``min_tokens``, as vLLM does).
        """
        if self.stop_reason is not None:
            return self.stop_reason
        self._ids.append(token_id)
        if not decode:
            return None
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # nothing new yet, or a character still incomplete
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        previous_len = len(self.text)
        self.text += delta
        return self._find_stop(previous_len) if check_stop else None

    def flush(self) -> None:
        """At the end of a completion: add text still held back (an incomplete character)."""
        if self.stop_reason is not None or self._read_offset == len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text):
            previous_len = len(self.text)
            self.text += new_text[len(prefix_text) :]
            self._find_stop(previous_len)
        self._prefix_offset = self._read_offset = len(self._ids)

    def _find_stop(self, previous_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, max(0, previous_len - len(s) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[: at + len(s)] if self._include_stop else self.text[:at]
        self.stop_reason = s
        return s

    def visible_text(self, finished: bool) -> str:
        """The text a stream may show now: all of it once finished, else minus the tail that
        could still turn out to begin a stop string."""
        if finished or self._include_stop or self._max_stop_len <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - (self._max_stop_len - 1))]
