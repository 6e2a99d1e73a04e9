"""The data plane: where a request goes and how it gets there and back.

- ``fields.py``: the few request fields the gateway reads (model, messages, max_tokens, ...).
- ``routing.py``: ``Router`` (explicit model or ``auto`` by complexity) -> ``RouteDecision``.
- ``proxy.py``: the ``Upstream`` protocol, ``LocalUpstream`` (retries before the first byte,
  relays SSE); ``remote.py``: ``RemoteUpstream`` through litellm; ``retry.py``: the policy.
- ``usage_relay.py``: the body sent upstream (``upstream_body``) and the usage read back from
  an answer (``Usage``, the SSE relay's usage handling).
- ``pool.py``, ``transport.py``: replicas (least outstanding + prefix affinity, ejection) and
  the lean HTTP transport to them; ``supervisor.py``: starts, watches and drains engines.
- ``hot_routes.py``, ``request_context.py``: the two completion routes outside FastAPI's
  stack; request ids, in-flight count and per-request metrics.
- ``engine_metrics.py``: ``/metrics/engines``, every replica's metrics relabelled.

Uses identity's ``Principal``; knows nothing of keys, stores or rate limits.
"""
