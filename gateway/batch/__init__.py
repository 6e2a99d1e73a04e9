"""Files and batches: OpenAI's Files and Batch APIs, per tenant, surviving restarts.

- ``files.py``: ``FileStore`` (metadata in Redis) over ``DiskStorage``; ``s3_storage.py`` +
  ``sigv4.py``: the same contents in S3 (or any S3-compatible store), signed by hand.
- ``batches.py``: ``BatchStore``, batch records and their lines' progress in Redis.
- ``batch_runner.py``: feeds each batch's lines to ``Gateway.serve`` at the ``batch`` priority
  class with its owner's principal; ``batch_routes.py``: the ``/v1/files`` and ``/v1/batches``
  routes.

May import: ``portico/``, ``gateway.body``, ``gateway.identity``, ``gateway.admission``,
``gateway.relay``, ``gateway.store``, ``gateway.metrics``; never the fleet or remotes wings
(tests/gateway/test_import_rules.py).
"""
