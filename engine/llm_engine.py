"""The engine's step loop: requests in; one schedule + model step + sample per ``step()``.

``LLMEngine`` ties the parts together and keeps nothing they already keep: the scheduler owns
the queues, the blocks and token-level stops (EOS, stop token ids, max_tokens); the runner owns
the KV tensors; the sampler is stateless. The engine owns what is about *text*: one
:class:`IncrementalDetokenizer` per completion, stop strings, and turning requests into
:class:`RequestOutput` objects. A request with ``n > 1`` runs as ``n`` child requests with the
same prompt (equal prompt blocks are shared by prefix caching); child ``i`` samples with
``seed + i`` when a seed is given, so the children differ but each is reproducible.
A request with ``structured_outputs`` is held back from the scheduler until its grammar is
compiled (in the background, see :mod:`engine.structured_output`); the others keep running.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from engine import kernels
from engine.async_scheduler import AsyncScheduler
from engine.async_scheduling import AsyncStepLoop
from engine.completions import Completion, Parent, make_output
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.lora import LoRARequest
from engine.lora.manager import LoRAManager
from engine.model_loader import LoadedModel, choose_device, load_model, resolve_quantization
from engine.model_runner import ModelRunner, num_kv_blocks
from engine.numerics import NumericsPath, refuse_uncovered_invariance, resolve_numerics
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from engine.pooling import PromptTap
from engine.request import Request, RequestStatus
from engine.sampler import Sampler
from engine.sampling_params import ParameterError, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.speculator import Proposer, Speculator
from engine.stats import EngineStats, engine_stats
from engine.structured_output import StructuredOutputManager
from engine.tenancy import TenantTag
from portico.registry import resolve

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from engine.distributed.leader import TensorParallelLeader
    from engine.multimodal import ImageInput

__all__ = [
    "CompletionOutput",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "TokenLogprob",
]

log = logging.getLogger(__name__)


class LLMEngine:
    """A synchronous engine: ``add_request`` queues, ``step`` runs one batch, ``abort`` frees.

    Promises: ``add_request`` either raises ValueError (a ``ParameterError`` naming the
    parameter) and changes nothing, or queues the request; every request eventually yields one
    RequestOutput with ``finished=True`` (from ``step`` or ``abort``); a finished or aborted
    request holds no KV block. Not thread-safe: one thread drives it (AsyncLLMEngine runs it in
    a dedicated thread).
    """

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        parallel: TensorParallelLeader | None = None,
    ) -> None:
        self.config = config
        # The dtype and activations this engine computes in, and why (/v1/models shows it).
        self.numerics = loaded.numerics or NumericsPath(
            str(loaded.dtype).removeprefix("torch."), "exact", "a model loaded by the caller"
        )
        log.info("numerics: %s (%s)", self.numerics.name, self.numerics.reason)
        # With --tensor-parallel-size > 1: the worker ranks (``loaded`` is rank 0's shard).
        self.parallel = parallel
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.max_model_len = _max_model_len(config, loaded.config.max_position_embeddings)
        self.vocab_size = loaded.config.vocab_size
        eos = set(loaded.config.eos_token_ids)
        if not eos and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        if parallel is None:
            num_gpu_blocks = num_kv_blocks(loaded, config)
            self.runner = ModelRunner(loaded, config, num_gpu_blocks)
        else:  # every rank holds as many blocks (of its own KV heads)
            num_gpu_blocks = parallel.num_gpu_blocks
            self.runner = parallel.make_runner(loaded, config)
        # Embedding and prompt-logprob requests read their prompt's hidden states here.
        self.prompt_tap = PromptTap(
            loaded.model.compute_logits,
            loaded.model.compute_scores if loaded.config.is_cross_encoder else None,
        )
        self.runner.prompt_tap = self.prompt_tap
        self.scheduler = (AsyncScheduler if config.async_scheduling else Scheduler)(
            config,
            num_gpu_blocks,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            num_cpu_blocks=self.runner.num_cpu_blocks,
        )
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(
                loaded.model, loaded.config,
                max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.cpu_lora_capacity, device=loaded.device,
                dtype=loaded.dtype, base_model_name=config.model_name,
            )  # fmt: skip
            self.runner.lora = self.lora
            for spec in config.lora_module_specs:
                self.lora.register(spec.name, spec.path, spec.base_model_name)
        self.speculation: Speculator | None = None
        if config.speculative is not None:
            proposer = self._make_proposer(config.speculative, loaded, num_gpu_blocks)
            self.speculation = Speculator(
                config.speculative, proposer, self.scheduler.max_model_len
            )
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, sorted(self.eos_token_ids), config.max_num_seqs,
            config.constraint_limits,
        )  # fmt: skip
        self._async = AsyncStepLoop(self) if config.async_scheduling else None
        # Requests whose grammar is still compiling, by id, in arrival order.
        self._waiting_for_grammar: dict[str, Request] = {}
        self._parents: dict[str, Parent] = {}
        self._completions: dict[str, tuple[Parent, Completion]] = {}
        self._last_step = (0.0, 0.0)  # (start, end) of the latest step, monotonic
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "num_prompt_tokens", "num_computed_prompt_tokens", "num_generation_tokens",
                "num_steps", "finished_stop", "finished_length", "finished_abort",
            ),
            0,
        )  # fmt: skip

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Resolve and load ``config.model`` on ``config.device`` and build the engine; with
        ``tensor_parallel_size`` > 1 start the worker ranks too (stop them with :meth:`close`)."""
        if config.tensor_parallel_size > 1:
            from engine.distributed.leader import TensorParallelLeader

            parallel, shard = TensorParallelLeader.start(config)
            try:
                return cls(config, shard, parallel)
            except BaseException:
                parallel.close()
                raise
        device = choose_device(config.device)
        source = resolve(config.model)
        quantization = resolve_quantization(config.quantization, source, device)
        on_triton = kernels.choose(device.type).device_type == "cuda"
        if config.batch_invariant and on_triton:
            refuse_uncovered_invariance(config, quantization)
        kernels.set_batch_invariant(config.batch_invariant and on_triton)
        path = resolve_numerics(
            config.dtype, config.gguf_activations, device, quantization == "gguf",
            triton_invariant=config.batch_invariant and on_triton,
        )  # fmt: skip
        if config.batch_invariant and not path.batch_invariant:
            raise ValueError(
                f"--batch-invariant: {path.name} on {device.type} ({path.reason}) is not batch "
                "invariant; on CPU use a GGUF model with --dtype auto or float32 (docs/numerics.md)"
            )
        loaded = load_model(
            source, path.torch_dtype, device, quantization, path.gguf_activations,
            config.load_format,
        )  # fmt: skip
        if kernels.batch_invariant() and loaded.config.is_multimodal:
            raise ValueError(
                "--batch-invariant on CUDA does not cover vision models: their towers run "
                "PyTorch's matmuls (docs/numerics.md)"
            )
        return cls(config, dataclasses.replace(loaded, numerics=path))

    def _make_proposer(
        self, spec: SpeculativeConfig, loaded: LoadedModel, num_gpu_blocks: int
    ) -> Proposer:
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        from engine.spec_decode.draft_model import DraftModelProposer

        assert spec.model is not None  # SpeculativeConfig requires it for draft_model
        source = resolve(spec.model)
        draft = load_model(source, loaded.dtype, loaded.device, self.config.quantization)
        return DraftModelProposer(draft, loaded, self.config.block_size, num_gpu_blocks)

    # ------------------------------------------------------------------ admission

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ParameterError (naming the parameter) if the request can never run here."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
            raise ParameterError("prompt", "prompt must contain at least one token")
        for token in prompt_token_ids:
            if isinstance(token, bool) or not isinstance(token, int):
                raise ParameterError("prompt", f"prompt token ids must be integers, got {token!r}")
            if not 0 <= token < self.vocab_size:
                raise ParameterError(
                    "prompt",
                    f"prompt token id {token} is outside the vocabulary [0, {self.vocab_size})",
                )
        if params.pooling is not None and (params.n != 1 or params.max_tokens != 1):
            raise ParameterError("pooling", "a pooling request samples exactly one token (n=1)")
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias)),
        ):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ParameterError(
                    name,
                    f"{name} token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                )
        self.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)
        if params.structured_outputs is not None:
            self.structured.check(params.structured_outputs)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tenant: TenantTag | None = None,
        mm_inputs: tuple[ImageInput, ...] = (),
    ) -> None:
        """Queue a request (``n`` children). ValueError on bad input; nothing allocated then.

        ``lora_request`` (from :attr:`lora`'s registry) runs it with that adapter; ``tenant``
        (None: the default tenant) is whom the scheduler's policy and KV quota charge."""
        if lora_request is not None and self.lora is None:
            raise ParameterError("model", "this engine was started without --enable-lora")
        self.check_request(prompt_token_ids, params)
        if request_id in self._parents:
            raise ParameterError("request_id", f"request_id {request_id!r} is already running")
        child_ids = [request_id]
        if params.n > 1:
            child_ids = [f"{request_id}#{i}" for i in range(params.n)]
        if any(cid in self._completions for cid in child_ids):
            raise ParameterError("request_id", f"request_id {request_id!r} is already running")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        prompt = list(prompt_token_ids)
        if params.pooling is not None or params.prompt_logprobs is not None:
            # Every prompt position must be computed: no prefix-cache hit may skip one.
            cache_salt = f"{cache_salt or ''}\x00prompt-read:{request_id}"
            self.prompt_tap.register(
                child_ids[0], len(prompt), params.pooling, params.prompt_logprobs
            )
        metrics = RequestMetrics(arrival_time=arrival, added_step=self._counters["num_steps"])
        if self._last_step[0] <= arrival < self._last_step[1]:  # it came in during that step
            metrics.inflight_step_start, metrics.inflight_step_end = self._last_step
        parent = Parent(request_id, prompt, [], metrics)
        for index, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, seed=seed)
            req = Request(
                child_id, prompt, child_params,
                arrival_time=arrival, priority=priority, cache_salt=cache_salt,
                lora_request=lora_request, tenant=tenant, mm_inputs=mm_inputs,
            )  # fmt: skip
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if params.structured_outputs is not None:
                req.grammar = self.structured.grammar_for(
                    params.structured_outputs, req.tenant.name
                )
            logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
            parent.completions.append(Completion(index, req, detok, logprobs))
        share_prompt = params.n > 1 and self.config.enable_prefix_caching
        for completion in parent.completions:
            if share_prompt and completion.index > 0:
                parent.pending.append(completion)
            else:
                self._admit(completion.request)
            self._completions[completion.request.request_id] = (parent, completion)
        self._parents[request_id] = parent
        self._counters["num_prompt_tokens"] += len(prompt) * params.n

    # ------------------------------------------------------------------ the step

    def _admit(self, req: Request) -> None:
        """To the scheduler now, or once its grammar is compiled (a grammar that already
        failed, e.g. cached as past its compile budget, is aborted at the next step)."""
        grammar = req.grammar
        if grammar is not None and (not grammar.is_ready or grammar.error is not None):
            self._waiting_for_grammar[req.request_id] = req
        else:
            self.scheduler.add_request(req)

    def _admit_compiled(self, touched: list[Parent]) -> None:
        """Hand the requests whose grammar just compiled to the scheduler; a failed compile
        aborts its request (the spec passed :meth:`check_request`, so this is rare)."""
        ready = [r for r in self._waiting_for_grammar.values() if r.grammar.is_ready]  # type: ignore[union-attr]
        if not ready and self._waiting_for_grammar and not self.scheduler.has_unfinished():
            # Nothing can run: wait a little for the compile instead of spinning.
            next(iter(self._waiting_for_grammar.values())).grammar.wait(0.01)  # type: ignore[union-attr]
            return
        for req in ready:
            del self._waiting_for_grammar[req.request_id]
            if req.grammar.error is None:  # type: ignore[union-attr]
                self.scheduler.add_request(req)
                continue
            parent, completion = self._completions[req.request_id]
            req.status = RequestStatus.FINISHED_ABORTED
            self._finish(parent, completion, time.monotonic())
            if not parent.touched:
                parent.touched = True
                touched.append(parent)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, detokenize; return outputs of requests that moved.

        With ``--async-scheduling`` the step is launched before the previous one is read
        (:mod:`engine.async_scheduling`), or runs synchronously where it must."""
        started = time.monotonic()
        touched: list[Parent] = []
        if self._waiting_for_grammar:
            self._admit_compiled(touched)
        if self._async is None or not self._async.step(touched):
            self._step_synchronously(touched)
        outputs = [self._make_output(p) for p in touched]
        self._last_step = (started, time.monotonic())
        return outputs

    def _step_synchronously(self, touched: list[Parent]) -> None:
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        self._counters["num_steps"] += 1
        if out.swap_out or out.swap_in:
            self.runner.swap(out.swap_out, out.swap_in)
        self._mark_scheduled(out)
        rows, logits = self.runner.execute(out)
        sampled, row_logprobs = self._sample(out, rows, logits) if rows else ({}, [])
        num_outputs = [r.num_output_tokens for r in rows]
        finished = {r.request_id for r in self.scheduler.update_from_output(out, sampled)}
        self._apply_tokens(out, rows, num_outputs, row_logprobs, finished, sampled, touched)

    def _apply_tokens(
        self,
        out: SchedulerOutput,
        rows: list[Request],
        num_outputs: list[int],
        row_logprobs: list[list[TokenLogprob | None]],
        finished: set[str],
        sampled: Mapping[str, object],
        touched: list[Parent],
    ) -> None:
        """Text, stop strings and outputs for the tokens the scheduler just appended to
        ``rows`` (each had ``num_outputs[i]`` tokens before)."""
        now = time.monotonic()
        num_generated = 0
        for req, lps, before in zip(rows, row_logprobs, num_outputs, strict=True):
            parent, completion = self._completions[req.request_id]
            # The scheduler appended these (a stop drops what a step verified after it).
            tokens = req.output_token_ids[before:]
            for i, token in enumerate(tokens):
                last = i == len(tokens) - 1
                done = finished if last else set()
                if self._on_token(parent, completion, token, lps[i], now, done) and not last:
                    req.truncate_output(before + i + 1)  # a stop string inside the step
                    break
            num_generated += req.num_output_tokens - before
            if not parent.touched:
                parent.touched = True
                touched.append(parent)
        for req, _ in out.scheduled:  # finished without a token (e.g. the context limit)
            if req.request_id in finished and req.request_id not in sampled:
                parent, completion = self._completions[req.request_id]
                self._finish(parent, completion, now)
                if not parent.touched:
                    parent.touched = True
                    touched.append(parent)
        self._counters["num_generation_tokens"] += num_generated

    def _sample(
        self, out: SchedulerOutput, rows: list[Request], logits: torch.Tensor
    ) -> tuple[dict[str, list[int]], list[list[TokenLogprob | None]]]:
        """Each row's tokens for this step (one, or accepted guesses then one) and logprobs."""
        grammars = [r.grammar for r in rows]
        constrained = any(g is not None for g in grammars)
        if out.spec_token_ids:
            guesses = [out.spec_token_ids.get(r.request_id, []) for r in rows]
            mask = None
            if constrained:  # the grammar masks every verified position
                mask = self.structured.fill_bitmask_for_guesses(grammars, guesses)
            verified = self.sampler.verify(logits, rows, guesses, mask)
            token_lists, logprobs = verified.token_ids, verified.logprobs
            assert self.speculation is not None  # guesses come only from it
            self.speculation.record(guesses, verified.num_accepted)
        else:
            mask = self.structured.fill_bitmask(grammars) if constrained else None
            result = self.sampler.sample(logits, rows, mask)
            token_lists = [[t] for t in result.token_ids]
            logprobs = [[lp] for lp in result.logprobs]
        if constrained:
            for g, tokens in zip(grammars, token_lists, strict=True):
                if g is not None:
                    g.accept_all(tokens)
        sampled = {r.request_id: t for r, t in zip(rows, token_lists, strict=True)}
        return sampled, logprobs

    def _mark_scheduled(self, out: SchedulerOutput) -> None:
        """Count the step's prefill and note when (time and step number) each of its requests
        was first scheduled."""
        now = time.monotonic()
        self._count_prefill(out)
        step_no = self._counters["num_steps"]
        for req, _ in out.scheduled:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            entry = self._completions.get(req.request_id)
            if entry is not None and entry[0].metrics.first_scheduled_step is None:
                entry[0].metrics.first_scheduled_step = step_no

    def _count_prefill(self, out: SchedulerOutput) -> None:
        """Prefill work of this step: every scheduled token that is not a plain decode."""
        num = 0
        for req, n in out.scheduled:
            ahead = req.num_tokens + req.num_output_placeholders  # placeholders: async only
            decode = ahead > req.num_prompt_tokens and req.num_computed_tokens == ahead - 1
            num += 0 if decode else n
        self._counters["num_computed_prompt_tokens"] += num

    def _on_token(
        self,
        parent: Parent,
        completion: Completion,
        token: int,
        logprob: TokenLogprob | None,
        now: float,
        finished: set[str],
    ) -> bool:
        """Take one appended token (text, stop strings, logprobs); True if the request ended."""
        req = completion.request
        metrics = parent.metrics
        self._release_pending(parent)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.first_token_step = self._counters["num_steps"]
        if req.first_token_time is None:
            req.first_token_time = now
        metrics.last_token_time = now
        if completion.logprobs is not None and logprob is not None:
            completion.logprobs.append(logprob)
        params = req.sampling_params
        stopped_by_token = (
            req.request_id in finished and req.status == RequestStatus.FINISHED_STOPPED
        )
        stop = completion.detokenizer.append(
            token,
            decode=not stopped_by_token or params.include_stop_str_in_output,
            check_stop=req.num_output_tokens >= params.min_tokens,
        )
        if stop is None and req.grammar is not None and req.grammar.is_terminated:
            if req.request_id not in finished:  # e.g. ignore_eos: the grammar still ends it
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                finished.add(req.request_id)
        if stop is None and req.grammar is not None and req.grammar.too_slow:
            if req.request_id not in finished:  # its masks would stall every step: cut it
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                finished.add(req.request_id)
        if stop is not None and req.request_id not in finished:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop)
        if stop is not None or req.request_id in finished:
            self._finish(parent, completion, now)
            return True
        return False

    def _release_pending(self, parent: Parent) -> None:
        """Child 0's prompt is computed (and cached): start its siblings."""
        for sibling in parent.pending:
            self._admit(sibling.request)
        parent.pending.clear()

    def _finish(self, parent: Parent, completion: Completion, now: float) -> None:
        self._release_pending(parent)
        if self.speculation is not None:
            self.speculation.forget(completion.request.request_id)
        if completion.finish_reason is not None:
            return
        req = completion.request
        detok = completion.detokenizer
        if detok.stop_reason is not None:
            completion.finish_reason, completion.stop_reason = "stop", detok.stop_reason
        else:
            detok.flush()
            completion.finish_reason = req.finish_reason or "abort"
            completion.stop_reason = req.stop_reason
        self._counters[f"finished_{completion.finish_reason}"] += 1
        parent.num_finished += 1
        if parent.num_finished == len(parent.completions):
            parent.metrics.finished_time = now

    def _make_output(self, parent: Parent) -> RequestOutput:
        output = make_output(parent, self.prompt_tap)
        if output.finished:
            self._parents.pop(parent.request_id, None)
            for c in parent.completions:
                self._completions.pop(c.request.request_id, None)
        return output

    # ------------------------------------------------------------------ abort, state

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request now: its blocks are freed before this returns.

        Returns the request's final output (``finish_reason="abort"`` on the completions that
        were still running), or None if the request is unknown or already finished.
        """
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        now = time.monotonic()
        parent.pending.clear()  # never handed to the scheduler: nothing to free
        for c in parent.completions:
            self._waiting_for_grammar.pop(c.request.request_id, None)
            if c.finish_reason is None:
                self.scheduler.finish_request(c.request.request_id, RequestStatus.FINISHED_ABORTED)
                self._finish(parent, c, now)
        return self._make_output(parent)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and the grammar compile workers
        (idempotent; no step may run after)."""
        self.structured.close()
        if self.parallel is not None:
            self.parallel.close()

    def has_unfinished(self) -> bool:
        return bool(self._parents) or self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and counters (:func:`engine_stats`)."""
        spec = self.speculation.stats if self.speculation is not None else None
        return engine_stats(
            self.scheduler.stats, self.structured.stats, spec, self._counters,
            lora_names=self.scheduler.lora_names(),
            max_lora=self.config.max_loras if self.lora is not None else 0,
            num_waiting_for_grammar=len(self._waiting_for_grammar),
            resident_lora_adapters=self.lora.resident_names() if self.lora is not None else (),
        )  # fmt: skip


def _max_model_len(config: EngineConfig, model_len: int) -> int:
    """``--max-model-len`` where given (never past the model's context), else the model's."""
    if config.max_model_len is not None and config.max_model_len > model_len:
        raise ValueError(
            f"--max-model-len {config.max_model_len} exceeds the model's context length "
            f"({model_len})"
        )
    return config.max_model_len or model_len
