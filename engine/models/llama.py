"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache.

All scheduled tokens of a step, prefill chunks and decodes together, pass the linear layers as
one ``[num_tokens, hidden]`` tensor; attention runs per request over its own cache blocks
(:mod:`engine.attention`). Q/K/V are one linear (``qkv_proj``) and gate/up are one linear
(``gate_up_proj``): fewer, bigger matmuls. The loader merges Hugging Face's separate weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine import kernels
from engine.attention import AttentionMetadata, attend_paged
from engine.model_config import ModelConfig
from engine.models.block_linear import BlockLinear, GGUFBlocks, block_matmul
from engine.models.rotary import RopeAngles, RotaryEmbedding

if TYPE_CHECKING:
    from engine.models.fused_step import FusedDecodeStep
    from engine.models.panel_step import FusedPanelStep


class RMSNorm(nn.Module):
    """Root-mean-square norm scaled by a learned weight (as in HF Llama; the formula is
    :func:`engine.kernels.rms_norm`). ``native_float32`` (set by the loader on the batch
    invariant float32 path, :func:`engine.models.panel_step.use_native_norms`): float32 runs the
    native kernel the fused panel step calls, so both compute the same bits."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native_float32 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_float32:
            return kernels.add_rms_norm(x, None, self.weight, self.eps, True)
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """``x += delta`` in place (the residual stream), then the norm of ``x``, through
        :func:`engine.kernels.add_rms_norm` (one native call in bfloat16 on CPU)."""
        return kernels.add_rms_norm(x, delta, self.weight, self.eps, self.native_float32)


class LlamaAttention(nn.Module):
    """Self-attention with grouped KV heads, RoPE, and the paged cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = BlockLinear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = BlockLinear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        rope: RopeAngles,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = kernels.rope_write_kv(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope, kv_cache,
            meta.slot_mapping,
        )  # fmt: skip
        out = attend_paged(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up as one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = BlockLinear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias
        )
        self.down_proj = BlockLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_up_proj(x), self.intermediate_size))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        rope: RopeAngles,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Add ``pending`` (the previous layer's MLP output) to the residual stream ``x`` in
        place, run this layer, and return its MLP output: the next ``pending``. Deferring the
        add lets it fuse with the next norm."""
        attn = self.self_attn(rope, self.input_layernorm.add_and_norm(x, pending), kv_cache, meta)
        return self.mlp(self.post_attention_layernorm.add_and_norm(x, attn))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention reads and writes the paged KV cache.

    ``forward`` returns the final hidden states of every scheduled token; the caller picks the
    rows it samples from and calls :meth:`compute_logits` on those only. With tied embeddings
    there is no ``lm_head`` module: the embedding matrix is the output projection.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.lm_head: nn.Linear | None = None
        if not cfg.tie_word_embeddings and not cfg.is_cross_encoder:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # A cross-encoder's score head (transformers' ``score``); it has no LM head, so the one
        # token each of its (pooling) requests samples comes from the tied embedding and is
        # thrown away.
        self.score: nn.Linear | None = None
        if cfg.is_cross_encoder:
            self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        # The output projection in GGUF blocks (set by the loader with quantization "gguf") and
        # prepacked for oneDNN (bf16 on CPU, see prepack_weights).
        self.lm_head_blocks: GGUFBlocks | None = None
        self.lm_head_packed: torch.Tensor | None = None
        # Small steps in one native call (set by the loader where it serves this model).
        self.fused_step: FusedDecodeStep | FusedPanelStep | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the ``[T]`` flattened tokens at ``positions``; returns hidden states [T, hidden].
        ``inputs_embeds`` (a vision model's image rows merged in) replaces the token
        embeddings; it is written in place (it becomes the residual stream)."""
        fused = self.fused_step if inputs_embeds is None else None
        if fused is not None and fused.serves(input_ids.shape[0]):
            done = fused.run(input_ids, positions, kv_caches, meta)
            if done is not None:
                return done[0]
        # a fresh tensor: the residual stream, in place
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.lookup(positions, x.dtype)
        pending: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            pending = layer(rope, x, kv_cache, meta, pending)
        return self.model.norm.add_and_norm(x, pending)

    def forward_and_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        rows: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, and :meth:`compute_logits` of ``hidden[rows]``: in one native call
        where the fused step serves the step and its head (one stream decoding), else the two
        calls. The same values either way."""
        fused = self.fused_step if inputs_embeds is None else None
        if fused is not None and fused.serves(input_ids.shape[0]):
            done = fused.run(input_ids, positions, kv_caches, meta, rows)
            if done is not None:
                hidden, logits = done
                if logits is None:
                    logits = self.compute_logits(hidden.index_select(0, rows))
                return hidden, logits
        hidden = self(input_ids, positions, kv_caches, meta, inputs_embeds)
        return hidden, self.compute_logits(hidden.index_select(0, rows))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for hidden states [N, hidden]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return block_matmul(hidden, weight, self.lm_head_blocks, None, self.lm_head_packed).float()

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """The score head's logits [..., num_labels] in float32 (a cross-encoder only)."""
        if self.score is None:
            raise ValueError("this model has no score head (it is not a cross-encoder)")
        weight = self.score.weight
        return torch.nn.functional.linear(hidden.to(weight.dtype), weight).float()

    def prepack_weights(self) -> int:
        """Reorder every projection's weight once for oneDNN (bf16 on CPU; elsewhere nothing
        happens). Returns how many weights were packed."""
        count = 0
        for module in self.modules():
            if isinstance(module, BlockLinear) and module.fp8 is None:
                module.packed = kernels.prepack_linear_weight(module.weight)
                count += module.packed is not None
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head_packed = kernels.prepack_linear_weight(weight)
        return count + (self.lm_head_packed is not None)
