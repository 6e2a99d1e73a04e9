"""Portico's inference engine: paged KV cache, continuous batching, its own kernels.

Where each concern lives: docs/internals.md ("The engine in one minute"). The engine core knows
no HTTP; :mod:`engine.server` puts the OpenAI routes in front of it.
"""
