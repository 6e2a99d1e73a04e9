"""Turns a scheduler step into flat tensors, runs the model over the paged KV cache, and
returns the logits of the rows to sample.

One flattened batch per step: the scheduled tokens of every request (prefill chunks and
decodes together) pass the linear layers as one ``[num_tokens, hidden]`` tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine import kernels, kv_cache_dtype, memory_plan
from engine.attention import AttentionMetadata
from engine.cuda_graphs import (
    DecodeBuffers,
    DecodeGraphs,
    DecodeStep,
    fallback_reason,
    plan_buckets,
)
from engine.kernels.huge_pages import huge_zeros
from engine.model_config import ModelConfig
from engine.model_loader import LoadedModel
from engine.models.host_step import HostStep
from engine.models.llava import LlavaForConditionalGeneration
from engine.models.qwen2_vl import Qwen2VLForConditionalGeneration
from engine.multimodal import EncoderCache, ImageInput

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.lora.manager import LoRAManager
    from engine.pooling import PromptTap
    from engine.request import Request
    from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (K and V) in a cache of ``dtype`` (int8: the
    values and each row's scale, :mod:`engine.kv_cache_dtype`)."""
    row = kv_cache_dtype.bytes_per_token_head(dtype, cfg.head_dim)
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * row


def cache_dtype_of(loaded: LoadedModel, engine_config: EngineConfig) -> torch.dtype:
    """The KV cache's torch dtype: ``--kv-cache-dtype``, ``auto`` being what the numerics path
    says (float16 on the default CPU path, engine.numerics) or else the model's dtype."""
    flag = engine_config.kv_cache_dtype
    if loaded.numerics is not None:
        flag = loaded.numerics.kv_cache_dtype(flag)
    return kv_cache_dtype.storage_dtype(flag, loaded.dtype)


def num_kv_blocks(loaded: LoadedModel, engine_config: EngineConfig) -> int:
    """How many KV blocks fit the budget: the override, else the CPU budget
    (``kv_cache_memory``), else on CUDA the engine's share of the device
    (``gpu_memory_utilization`` of its total) less what the engine already holds.
    """
    if engine_config.num_gpu_blocks_override is not None:
        return engine_config.num_gpu_blocks_override
    cache_dtype = cache_dtype_of(loaded, engine_config)
    per_block = kv_cache_bytes_per_block(loaded.config, engine_config.block_size, cache_dtype)
    free, total, held = (0, 0, 0)
    if loaded.device.type == "cuda":
        free, total, held = memory_plan.cuda_memory(loaded.device)
    budget = memory_plan.kv_cache_budget(engine_config, loaded.device.type, free, total, held)
    return memory_plan.num_blocks_in(budget, per_block)


def _zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's KV cache, zeroed; on the CPU on huge pages (engine/kernels/huge_pages.py): a
    decode step reads it through the block table, a 4 KB page at a time on ordinary pages."""
    if device.type == "cpu":
        return huge_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner:
    """Owns the KV cache tensors and runs one model step per scheduler output.

    ``kv_caches`` holds one tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``
    (0 = K, 1 = V), on the model's device, in ``--kv-cache-dtype`` (an int8 row carries its scale
    in 4 more bytes: :mod:`engine.kv_cache_dtype`). ``cpu_kv_caches`` is the swap pool (same
    layout, ``num_cpu_blocks`` blocks) used when preemption mode is ``swap``. With CUDA graphs
    (``graphs``, engine.cuda_graphs) the device cache has one more block, the padding rows'
    scratch block, which the scheduler never hands out. Not thread-safe:
    one step at a time.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        engine_config: EngineConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int | None = None,
    ) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = engine_config.block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.lora: LoRAManager | None = None  # set by the engine with --enable-lora
        self.prompt_tap: PromptTap | None = None  # set by the engine: embeddings, prompt logprobs
        self.encoder_cache = EncoderCache()  # encoded images (vision models only)
        cfg = loaded.config
        self.cache_dtype = cache_dtype_of(loaded, engine_config)
        # Decode steps replay CUDA graphs (engine.cuda_graphs) on one CUDA device unless
        # --enforce-eager; their padding rows write to one more block than the pool's. Under
        # --batch-invariant every step runs eager (graphs would capture the split-K kernel's
        # setup; the invariant kernels are not captured yet).
        self.enforce_eager = (
            engine_config.enforce_eager
            or engine_config.tensor_parallel_size > 1
            or kernels.batch_invariant()
        )
        with_graphs = self.device.type == "cuda" and not self.enforce_eager
        shape = kv_cache_dtype.cache_shape(
            self.cache_dtype, num_gpu_blocks + (1 if with_graphs else 0), self.block_size,
            cfg.num_key_value_heads, cfg.head_dim,
        )  # fmt: skip
        self.kv_caches = [
            _zeroed_cache(shape, self.cache_dtype, self.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        if num_cpu_blocks is None:
            per_block = kv_cache_bytes_per_block(cfg, self.block_size, self.cache_dtype)
            swapping = engine_config.preemption_mode == "swap"
            num_cpu_blocks = engine_config.swap_space_bytes // per_block if swapping else 0
        self.num_cpu_blocks = num_cpu_blocks
        cpu_shape = (2, num_cpu_blocks, *shape[2:])
        pin = self.device.type == "cuda"
        # torch.empty: the OS hands out pages only when a block is first swapped out.
        self.cpu_kv_caches = (
            [
                torch.empty(cpu_shape, dtype=self.cache_dtype, pin_memory=pin)
                for _ in range(cfg.num_hidden_layers)
            ]
            if num_cpu_blocks
            else []
        )
        # Small steps of the float32 panel path write their inputs into persistent buffers
        # (engine/models/host_step.py); None where that path does not serve.
        max_len = engine_config.max_model_len or cfg.max_position_embeddings
        self.host_step = (
            HostStep.build(self.model, self.kv_caches, -(-max_len // self.block_size))
            if self.device.type == "cpu"
            else None
        )
        self.graphs: DecodeGraphs | None = None
        if with_graphs and not kernels.decode_attention_capturable(self.kv_caches[0]):
            log.warning(
                "decode steps run eager: attention over a %s cache reads host-side "
                "lengths that a CUDA graph replay would not update",
                self.cache_dtype,
            )
        elif with_graphs:
            max_len = engine_config.max_model_len or cfg.max_position_embeddings
            # --async-scheduling loads step N+1 while step N's copies may still be in flight
            buffers = DecodeBuffers(
                engine_config.max_num_seqs, -(-max_len // self.block_size), self.block_size,
                scratch_block=num_gpu_blocks, device=self.device,
                staging_sets=2 if engine_config.async_scheduling else 1,
            )  # fmt: skip
            buckets = plan_buckets(engine_config.max_num_seqs)
            self.graphs = DecodeGraphs(self.model, self.kv_caches, buffers, buckets)
            self.graphs.capture()

    def execute(
        self,
        out: SchedulerOutput,
        sampled: torch.Tensor | None = None,
        sampled_rows: Mapping[str, int] | None = None,
    ) -> tuple[list[Request], torch.Tensor]:
        """Run the scheduled tokens; return the requests that need a sampled token this step
        (prefill complete, or a decode) and their logits ``[N, vocab]`` (float32), row ``i``
        for the LAST scheduled token of request ``i``. A request verifying guesses
        (``out.spec_token_ids``) gets ``1 + len(guesses)`` consecutive rows instead: its last
        real token's, then each guess's.

        Asynchronous scheduling: a request whose input token is a placeholder (sampled by the
        previous step, not read yet) takes it from ``sampled`` (that step's ids, on this
        device) at row ``sampled_rows[request_id]``, copied on the device.
        """
        if not out.scheduled:
            return [], torch.empty(0, self.config.vocab_size, device=self.device)
        scheduled = out.scheduled if self.lora is None else self.lora.order(out.scheduled)
        flat = _FlatStep.of(out, scheduled, sampled_rows)
        token_ids, positions, query_lens = flat.token_ids, flat.positions, flat.query_lens
        seq_lens, tables, sample_rows = flat.seq_lens, flat.tables, flat.sample_rows
        to_sample, placeholders, image_spans = flat.to_sample, flat.placeholders, flat.image_spans
        if max(seq_lens) > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence of {max(seq_lens)} tokens exceeds the model's context of "
                f"{self.config.max_position_embeddings} positions"
            )
        if self.lora is not None:
            self.lora.prepare([(req.lora_request, n) for req, n in scheduled])
        from_sampled: list[int] = []  # per token: the row of ``sampled`` it takes, or -1
        if placeholders:
            if sampled is None or min(row for _, row in placeholders) < 0:
                raise ValueError("a placeholder input token without the step that samples it")
            from_sampled = [-1] * len(token_ids)
            for at, row in placeholders:
                from_sampled[at] = row
        graphs = None if image_spans else self.graphs  # image rows never replay a graph
        if graphs is not None and self._graph_serves(out, query_lens, len(to_sample)):
            step = DecodeStep(token_ids, positions, seq_lens, tables, from_sampled or None)
            hidden, logits = graphs.run(step, sampled if from_sampled else None)
            if self.prompt_tap:
                self.prompt_tap.read(scheduled, hidden)
            return to_sample, logits
        if (
            self.host_step is not None
            and to_sample
            and self.lora is None
            and not from_sampled
            and not image_spans
            and flat.mrope is None
            and not self.prompt_tap  # it reads the step's hidden states
        ):
            host_logits = self.host_step.run(token_ids, query_lens, seq_lens, tables, sample_rows)
            if host_logits is not None:
                return to_sample, host_logits
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        pos = torch.tensor(positions if flat.mrope is None else flat.mrope, dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        if from_sampled:
            _resolve_placeholders(input_ids, from_sampled, sampled)
        with torch.inference_mode():
            embeds = self._merge_images(input_ids, image_spans) if image_spans else None
            if not to_sample:
                hidden = self.model(input_ids, pos, self.kv_caches, meta, embeds)
                if self.prompt_tap:  # requests that read their prompt's hidden states
                    self.prompt_tap.read(scheduled, hidden)
                return [], torch.empty(0, self.config.vocab_size, device=self.device)
            rows = torch.tensor(sample_rows, dtype=torch.int64).to(self.device)
            # One native call for a small step's layers and head where it serves.
            hidden, logits = self.model.forward_and_logits(
                input_ids, pos, self.kv_caches, meta, rows, embeds
            )
            if self.prompt_tap:
                self.prompt_tap.read(scheduled, hidden)
        return to_sample, logits

    def _merge_images(
        self, input_ids: torch.Tensor, spans: list[tuple[int, Request, int, int]]
    ) -> torch.Tensor:
        """The step's input embeddings with each scheduled image token's row replaced by its
        image's encoded row. An image first computed in this step is encoded here, alone (its
        rows never depend on what else the step holds), unless the encoder cache has it (an
        image whose tokens are all in the prefix cache is never encoded); an image's rows are
        kept on it until its last token is computed (chunked prefill), then dropped."""
        model = self.model
        if not isinstance(model, LlavaForConditionalGeneration | Qwen2VLForConditionalGeneration):
            raise ValueError(f"model '{self.config.architecture}' does not take images")
        pending: dict[int, tuple[ImageInput, str | None]] = {}
        for _, req, start, end in spans:
            for image in req.mm_inputs:
                if image.embeds is None and image.offset < end and image.end > start:
                    pending[id(image)] = (image, req.cache_salt)
        for image, salt in pending.values():
            rows = self.encoder_cache.get(salt, image.content_hash)
            if rows is None:
                if isinstance(model, Qwen2VLForConditionalGeneration):
                    if image.grid is None:
                        raise ValueError("a Qwen2-VL image needs its grid (prepare_images)")
                    rows = model.encode_image(image.pixel_values, image.grid)
                else:
                    rows = model.encode_images(image.pixel_values.unsqueeze(0).to(self.device))[0]
                self.encoder_cache.put(salt, image.content_hash, rows)
            image.embeds = rows
        embeds = model.model.embed_tokens(input_ids)
        done: list[ImageInput] = []
        for flat, req, start, end in spans:
            for image in req.mm_inputs:
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo >= hi or image.embeds is None:
                    continue
                embeds[flat + lo - start : flat + hi - start] = image.embeds[
                    lo - image.offset : hi - image.offset
                ]
                if hi == image.end:
                    done.append(image)
        for image in done:  # after the loop: n > 1 siblings share their ImageInputs
            image.embeds = None
        return embeds

    def _graph_serves(self, out: SchedulerOutput, query_lens: list[int], num_sampled: int) -> bool:
        """Whether a captured decode graph runs this step (:func:`fallback_reason`)."""
        graphs = self.graphs
        return (
            graphs is not None
            and fallback_reason(
                device_type=self.device.type,
                enforce_eager=self.enforce_eager,
                query_lens=query_lens,
                num_sampled=num_sampled,
                has_guesses=bool(out.spec_token_ids),
                has_lora_rows=any(req.lora_request is not None for req, _ in out.scheduled),
                max_bucket=graphs.max_bucket,
            )
            is None
        )

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy blocks device -> CPU (``(gpu_block, cpu_block)`` pairs), then CPU -> device
        (``(cpu_block, gpu_block)`` pairs), in every layer."""
        if (swap_out or swap_in) and not self.cpu_kv_caches:
            raise RuntimeError("swap requested but this runner has no CPU swap space")
        if swap_out:
            src = torch.tensor([g for g, _ in swap_out], device=self.device)
            dst = torch.tensor([c for _, c in swap_out])
            for gpu, cpu in zip(self.kv_caches, self.cpu_kv_caches, strict=True):
                cpu[:, dst] = gpu[:, src].to("cpu")
        if swap_in:
            src = torch.tensor([c for c, _ in swap_in])
            dst = torch.tensor([g for _, g in swap_in], device=self.device)
            for gpu, cpu in zip(self.kv_caches, self.cpu_kv_caches, strict=True):
                gpu[:, dst] = cpu[:, src].to(self.device, non_blocking=True)


def _resolve_placeholders(
    input_ids: torch.Tensor, from_sampled: list[int], sampled: torch.Tensor | None
) -> None:
    """Copy each placeholder token from the previous step's ids, on the device (no host read)."""
    assert sampled is not None  # execute checked it
    dst = [i for i, j in enumerate(from_sampled) if j >= 0]
    src = [from_sampled[i] for i in dst]
    dst_t = torch.tensor(dst, dtype=torch.int64).to(input_ids.device, non_blocking=True)
    src_t = torch.tensor(src, dtype=torch.int64).to(input_ids.device, non_blocking=True)
    input_ids.index_copy_(0, dst_t, sampled.index_select(0, src_t).to(input_ids.dtype))


@dataclass
class _FlatStep:
    """A step's scheduled tokens laid out flat, as the model takes them (ModelRunner.execute)."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    to_sample: list[Request] = field(default_factory=list)
    placeholders: list[tuple[int, int]] = field(default_factory=list)  # (token index, row)
    # (flat row, request, start, end) of the requests whose scheduled tokens touch an image
    image_spans: list[tuple[int, Request, int, int]] = field(default_factory=list)
    # M-RoPE: the step's (temporal, height, width) positions, once an image token needs them
    mrope: list[list[int]] | None = None

    def add_mrope(self, positions: list[int], three: list[list[int]] | None) -> None:
        """Extend the three M-RoPE rows by one request's positions (``three``, or the same
        numbers in every row), first filling them with the step's earlier positions."""
        if self.mrope is None:
            self.mrope = [list(self.positions) for _ in range(3)]
        for row, add in zip(self.mrope, three or (positions, positions, positions), strict=True):
            row.extend(add)

    @classmethod
    def of(
        cls,
        out: SchedulerOutput,
        scheduled: Sequence[tuple[Request, int]],
        sampled_rows: Mapping[str, int] | None,
    ) -> _FlatStep:
        flat = cls()
        token_ids, placeholders, image_spans = flat.token_ids, flat.placeholders, flat.image_spans
        for req, num_new in scheduled:
            guesses = out.spec_token_ids.get(req.request_id, ())
            start = req.num_computed_tokens
            end = start + num_new
            known = req.all_token_ids[start : end - len(guesses)]
            if req.mm_inputs and start < req.mm_inputs[-1].end:
                image_spans.append((len(token_ids), req, start, end - len(guesses)))
            token_ids.extend(known)
            if len(known) < end - len(guesses) - start:  # its last token is on the device
                row = sampled_rows.get(req.request_id, -1) if sampled_rows else -1
                placeholders.append((len(token_ids), row))
                token_ids.append(0)
            token_ids.extend(guesses)
            if req.mrope_positions is None and flat.mrope is None:
                flat.positions.extend(range(start, end))
            else:  # M-RoPE (engine/models/qwen2_vl.py): the request's rows, sliced
                positions, three = req.positions(start, end)
                if three is not None or flat.mrope is not None:
                    flat.add_mrope(positions, three)
                flat.positions.extend(positions)
            flat.query_lens.append(num_new)
            flat.seq_lens.append(end)
            flat.tables.append(out.block_tables[req.request_id])
            if end - len(guesses) == req.num_tokens + req.num_output_placeholders:
                flat.to_sample.append(req)
                flat.sample_rows.extend(range(len(token_ids) - 1 - len(guesses), len(token_ids)))
        return flat
