"""Multi-LoRA serving: adapters in PEFT's format applied per row on top of the base model.

``adapter`` reads and checks an adapter folder and lays its weights out for the fused
projections; ``manager`` keeps the registry, the CPU cache (LRU) and the device slots;
``ops`` holds the batched shrink/expand (PyTorch reference and the Triton kernel).
"""

from engine.lora.adapter import LoRAError, LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
