"""The engine's OpenAI-compatible HTTP server (``portico engine``): routes, drain, health and
metrics over :class:`engine.async_engine.AsyncLLMEngine`."""
