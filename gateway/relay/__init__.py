"""The request relay: where one request goes and how it gets there and back.

- ``routing.py``: ``Router`` (explicit model or ``auto`` by complexity) -> ``RouteDecision``.
- ``proxy.py``: the ``Upstream`` protocol and ``LocalUpstream`` (a local engine pool: retries
  before the first byte, the engine-hop headers, the relayed SSE stream); ``engine_hop.py``:
  the tenant headers of the hop (names and parsing: portico/contract.py).
- ``usage_relay.py``: the body sent upstream (``upstream_body``) and the usage read back
  (``Usage``, the SSE relay's usage handling); ``output_tokens.py``: output counted when a
  provider reports no usage; ``budget_stop.py``: a money budget's stop inside a stream.
- ``retry.py``: the retry policy; ``transport.py``: the lean HTTP/1.1 transport to upstreams.
- ``hot_routes.py``, ``request_context.py``: the two completion routes outside FastAPI's
  stack; request ids, in-flight count and per-request metrics.
- ``long_prompts.py``: the per-model long-prompt policy; ``responses_store.py``: stored
  Responses per tenant (``previous_response_id``).

May import: ``portico/``, ``gateway.body``, ``gateway.identity``, ``gateway.admission``,
``gateway.fleet`` (the pools it sends to), ``gateway.store``, ``gateway.metrics``; never the
remotes or batch wings, nor the modules at ``gateway/``'s top (tests/gateway/test_import_rules.py).
"""
