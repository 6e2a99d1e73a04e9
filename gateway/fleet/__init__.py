"""The engine fleet: the local engines, their replicas, and what each one holds.

- ``supervisor.py``: starts, watches, restarts and drains engine processes;
  ``discovery.py``: replicas found in DNS (a headless Service).
- ``pool.py``: a model's replicas (least outstanding, prefix-aware, ejection and probes);
  ``replica_load.py``: the exact load this gateway put on each replica and the wait it
  predicts; ``prefix_index.py``: which replica holds which prefix blocks, fed by the engines'
  block events and hashed with the contract's block hash (portico/contract.py).
- ``adapters.py`` + ``adapter_admin.py``: LoRA adapters as tenant-scoped models, loaded onto
  the engines that serve their base model.
- ``engine_admin.py``, ``engine_metrics.py``: ``GET /admin/v1/engines`` and
  ``/metrics/engines``, every replica's state and metrics.

May import: ``portico/``, ``gateway.body``, ``gateway.identity``, ``gateway.store``,
``gateway.metrics``; never the relay, remotes or batch wings, nor admission
(tests/gateway/test_import_rules.py).
"""
