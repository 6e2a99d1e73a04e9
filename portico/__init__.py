"""Portico: an edge gateway for OpenAI-compatible LLM traffic with its own inference engine."""

__version__ = "0.1.0"
