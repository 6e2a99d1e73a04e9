"""Offline batch inference: ``LLM(model=...).generate(prompts, params)``, ``.chat(...)`` and
``.embed(prompts)``.

All prompts of one call are queued together and stepped to completion, so they share batches
(continuous batching) exactly as server traffic does. Outputs come back in prompt order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.pooling_params import PoolingParams, pooler_config_for
from engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """A loaded model with an engine, for scripts and benchmarks (not thread-safe).

    ``engine_kwargs`` are :class:`EngineConfig` fields (``max_num_seqs=...``,
    ``enable_prefix_caching=False``, ``num_gpu_blocks_override=...``). A string prompt is
    tokenized with the model's tokenizer (its default special tokens); a list of ints is used
    as is.
    """

    def __init__(self, model: str = "smollm2-135m", **engine_kwargs: Any) -> None:
        self.engine = LLMEngine.from_config(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere (tests reuse one loaded model across engines)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm.tokenizer = engine.tokenizer
        llm._next_id = 0
        return llm

    def generate(
        self,
        prompts: str | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; one RequestOutput (finished) per prompt, in order."""
        batch = self._as_token_lists(prompts)
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(batch):
            raise ValueError(f"params has {len(per_prompt)} entries for {len(batch)} prompts")
        return self._run(batch, per_prompt)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or a list of them, using
        the tokenizer's chat template."""
        if not messages:
            raise ValueError("messages must not be empty")
        conversations: list[Any] = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conversation), tokenize=False, add_generation_prompt=add_generation_prompt
            )
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, params)

    def embed(
        self, prompts: str | Sequence[Prompt], pooling: PoolingParams | None = None
    ) -> list[list[float]]:
        """One embedding per prompt, in order: the model's pooling (its sentence-transformers
        files or ``pooler_config``, else last token, normalised) unless ``pooling`` is given."""
        if pooling is None:
            config = self.engine.config
            pooling = pooler_config_for(config.model, config.pooler_config).params()
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        batch = self._as_token_lists(prompts)
        return [out.embedding or [] for out in self._run(batch, [params] * len(batch))]

    def _as_token_lists(self, prompts: str | Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, str):
            return [self.tokenizer.encode(prompts)]
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):
            return [list(items)]  # type: ignore[arg-type]
        out: list[list[int]] = []
        for p in items:
            out.append(self.tokenizer.encode(p) if isinstance(p, str) else list(p))
        return out

    def _run(self, batch: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except ValueError:
            for request_id in ids:  # a bad prompt: leave nothing queued
                self.engine.abort(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[i] for i in ids]
