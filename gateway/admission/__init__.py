"""Admission: whether a request may run now, and what it is charged.

- ``admission.py``: ``Admission``, the policy (bucket sets per tenant/key/model, token
  reservation, settle and release, 429s in OpenAI's shape, ``x-ratelimit-*`` headers).
- ``failover.py``: ``FailoverLimiter``, the only place that decides Redis or fallback.
- ``limiter.py`` + ``limiter.lua``: the mechanism (one atomic script; a local twin).
- ``redis_pipe.py``: one pipelined connection for the limiter's scripts.
- ``abuse.py``: per-address limits before authentication and on the admin API.
- ``usage_recorder.py``: usage summed in memory, written to identity's ledger in batches.
- ``prompt_tokens.py``: exact prompt token counts for the reservation.

May import: ``portico/``, ``gateway.identity``, ``gateway.body`` (the prompt it counts),
``gateway.store``; never the relay, fleet, remotes or batch wings
(tests/gateway/test_import_rules.py).
"""
