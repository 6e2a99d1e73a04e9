"""The architecture numbers of a Llama-family model, read once from config.json or GGUF metadata.

:class:`ModelConfig` is what the model, the loader, the KV-cache sizing and the engine agree on.
It is frozen: nothing changes a model's shape after loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from portico.contract import QWEN_VL_ARCHITECTURES, VISION_ARCHITECTURES

# Architectures that share engine/models/llama.py. Qwen2 differs only by q/k/v biases. The
# *ForSequenceClassification checkpoints are the same decoder with a score head in place of the
# LM head: cross-encoders (rerankers) that serve /v1/score and /v1/rerank.
GENERATIVE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CROSS_ENCODER_ARCHITECTURES = (
    "LlamaForSequenceClassification",
    "MistralForSequenceClassification",
    "Qwen2ForSequenceClassification",
)
# Vision-language checkpoints: a vision tower and projector in front of a Llama-family decoder
# (engine/models/llava.py); the decoder's numbers come from the folder's ``text_config``.
SUPPORTED_ARCHITECTURES = (
    GENERATIVE_ARCHITECTURES + CROSS_ENCODER_ARCHITECTURES + VISION_ARCHITECTURES
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2).

    ``rope_scaling`` is None for plain RoPE, else a dict with ``rope_type`` in
    :data:`SUPPORTED_ROPE_TYPES` and that type's parameters (Hugging Face's names).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias also sets o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Outputs of the score head of a *ForSequenceClassification checkpoint; 0: a causal LM.
    num_labels: int = 0
    # What turns the head's logit into the served score: "sigmoid" (vLLM's default for one
    # label) or "identity" (the raw logit), as the checkpoint's sentence-transformers
    # activation names it.
    score_activation: str = "sigmoid"
    # A vision-language model's config.json less its text_config (the vision tower, the
    # projector, the image token id: engine/models/llava.py reads it); None: text only.
    multimodal: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"RoPE scaling '{rope_type}' is not supported (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)})"
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def is_cross_encoder(self) -> bool:
        """A sequence classifier: its score head, not an LM head, reads the last hidden state."""
        return self.num_labels > 0

    @property
    def is_multimodal(self) -> bool:
        """A vision-language model: chat messages may carry images."""
        return self.multimodal is not None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        architectures = raw.get("architectures") or ["LlamaForCausalLM"]
        architecture = str(architectures[0])
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture '{architecture}' is not supported (supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if architecture in VISION_ARCHITECTURES:
            return cls._from_hf_vision(architecture, raw)
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        # transformers 5 moves rope_theta and the scaling into "rope_parameters".
        rope_params = dict(raw.get("rope_parameters") or {})
        rope_theta = float(rope_params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = dict(raw.get("rope_scaling") or rope_params or {})
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = {}
        if scaling and "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = raw.get("max_position_embeddings")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        is_qwen2 = architecture.startswith("Qwen2")
        max_positions = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window")
        if window and raw.get("use_sliding_window", True) and int(window) < max_positions:
            # No sliding-window attention here: cap the context where full attention is exact.
            max_positions = int(window)
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=max_positions,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling or None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_labels=_num_labels(architecture, raw),
            score_activation=(
                _score_activation(raw) if architecture in CROSS_ENCODER_ARCHITECTURES else "sigmoid"
            ),
        )

    @classmethod
    def _from_hf_vision(cls, architecture: str, raw: Mapping[str, Any]) -> ModelConfig:
        """A LLaVA folder: the decoder from ``text_config`` (a Llama-family model), the rest
        kept in ``multimodal``."""
        if architecture in QWEN_VL_ARCHITECTURES:
            return cls._from_hf_qwen2_vl(architecture, raw)
        text = dict(raw.get("text_config") or {})
        text_type = str(text.get("model_type", "llama"))
        text_arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(text_type)
        if text_arch is None:
            raise ValueError(
                f"{architecture} with a '{text_type}' text model is not supported (llama, mistral)"
            )
        for key in ("eos_token_id", "bos_token_id"):
            text.setdefault(key, raw.get(key))
        text_cfg = cls.from_hf({**text, "architectures": [text_arch]})
        multimodal = {k: v for k, v in raw.items() if k != "text_config"}
        return replace(text_cfg, architecture=architecture, multimodal=multimodal)

    @classmethod
    def _from_hf_qwen2_vl(cls, architecture: str, raw: Mapping[str, Any]) -> ModelConfig:
        """A Qwen2-VL or Qwen2.5-VL folder: the Qwen2 decoder from ``text_config``
        (transformers 5) or the top level (the original layout), its M-RoPE ``mrope_section``
        moved into ``multimodal`` beside the vision config (engine/models/qwen2_vl.py)."""
        text = dict(
            raw.get("text_config") or {k: v for k, v in raw.items() if k != "vision_config"}
        )
        for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
            text.setdefault(key, raw.get(key))
        rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
        section = rope.pop("mrope_section", None)
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        if kind not in ("default", "mrope"):
            raise ValueError(f"{architecture} with RoPE scaling '{kind}' is not supported")
        text["rope_theta"] = rope.get("rope_theta", text.get("rope_theta", 1000000.0))
        text_cfg = cls.from_hf({**text, "architectures": ["Qwen2ForCausalLM"]})
        multimodal = {k: v for k, v in raw.items() if k != "text_config"}
        multimodal["mrope_section"] = section
        return replace(text_cfg, architecture=architecture, multimodal=multimodal)

    @classmethod
    def from_gguf_metadata(
        cls, meta: Mapping[str, Any], vocab_size: int, tied: bool
    ) -> ModelConfig:
        """Build from GGUF key/values (``general.architecture`` = llama or qwen2)."""
        arch = str(meta.get("general.architecture", "llama"))
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"GGUF architecture '{arch}' is not supported (llama, qwen2)")
        hidden = int(meta[f"{arch}.embedding_length"])
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
        scaling: dict[str, Any] = {}
        scaling_type = meta.get(f"{arch}.rope.scaling.type")
        if scaling_type in ("linear", "yarn"):
            scaling = {
                "rope_type": scaling_type,
                "factor": float(meta[f"{arch}.rope.scaling.factor"]),
                "original_max_position_embeddings": int(
                    meta.get(
                        f"{arch}.rope.scaling.original_context_length",
                        meta[f"{arch}.context_length"],
                    )
                ),
            }
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            architecture="Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM",
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_hidden_layers=int(meta[f"{arch}.block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(meta[f"{arch}.context_length"]),
            rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling or None,
            tie_word_embeddings=tied,
            qkv_bias=arch == "qwen2",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
        )


def _num_labels(architecture: str, raw: Mapping[str, Any]) -> int:
    """The score head's size of a cross-encoder checkpoint (0 for a causal LM). transformers
    writes ``id2label`` (``num_labels`` is derived from it) and defaults to 2 labels.

    Only ``num_labels`` = 1 is served: that is a reranker's relevance logit, the one number
    /v1/score and /v1/rerank return (vLLM applies a sigmoid to it); a multi-label classifier
    has no single score to give."""
    if architecture not in CROSS_ENCODER_ARCHITECTURES:
        return 0
    num_labels = int(raw.get("num_labels") or len(raw.get("id2label") or {}) or 2)
    if num_labels != 1:
        raise ValueError(
            f"{architecture} with num_labels={num_labels} is not supported: only a "
            "cross-encoder with one label (a reranker's relevance score) is served"
        )
    return num_labels


SCORE_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


def _score_activation(raw: Mapping[str, Any]) -> str:
    """The activation a cross-encoder's config names (sentence-transformers' ``activation_fn``
    under ``sentence_transformers``, or its older ``sbert_ce_default_activation_function``),
    as vLLM reads it; none named: the sigmoid. One it names that we do not know is refused
    rather than silently replaced by another."""
    st = raw.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, Mapping) else None
    name = name or raw.get("sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid"
    if name not in SCORE_ACTIVATIONS:
        raise ValueError(
            f"score activation {name!r} is not supported (supported: "
            f"{', '.join(SCORE_ACTIVATIONS)})"
        )
    return SCORE_ACTIVATIONS[name]
