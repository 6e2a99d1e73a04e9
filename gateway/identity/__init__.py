"""Identity: who is calling, and what their tenant may do.

- ``auth.py``: the one principal resolver (``Authenticator``: API key or JWT -> ``Principal``)
  and ``open_identity``, which builds it on the Redis client the gateway hands in.
- ``tenants.py``: ``TenantStore``, tenants and keys in Redis (keys stored as HMACs only).
- ``records.py``, ``plans.py``: the tenant/key records and admin bodies; the plans and limits.
- ``usage.py``: ``UsageLedger``, usage per tenant, model and day (read by the admin API).
- ``jwt_auth.py``, ``principal.py``: JWT verification; the ``Principal`` every part receives.
- ``admin.py``, ``keys_cli.py``: the ``/admin/v1`` REST API and ``portico keys``, its client.

May import: ``portico/`` and ``gateway.store``; nothing of admission or the wings
(tests/gateway/test_import_rules.py; ``portico keys`` reads the admin key file's name from
``gateway.cli``, the one listed exception).
"""
