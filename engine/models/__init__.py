"""Model implementations over the paged KV cache (the Llama family first)."""

from engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
