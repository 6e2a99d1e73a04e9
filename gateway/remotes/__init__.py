"""The remote tiers: model providers the gateway forwards to when no local engine serves.

- ``openai_remote.py``: ``OpenAIRemoteUpstream``, OpenAI-compatible providers over the relay's
  lean transport, with its own pool of base URLs.
- ``remote.py``: ``RemoteSpec`` and ``RemoteUpstream``, translation providers (Anthropic,
  Bedrock, ...) through litellm.

A remote never receives the engine hop's ``x-portico-*`` headers. May import: ``portico/``,
``gateway.body``, ``gateway.identity``, ``gateway.relay`` (the ``Upstream`` protocol, retries,
usage), ``gateway.fleet`` (pools), ``gateway.store``, ``gateway.metrics``; never the batch wing
(tests/gateway/test_import_rules.py).
"""
