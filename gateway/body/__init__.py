"""The request body as the gateway reads it: the few fields it needs, checked once.

- ``fields.py``: ``RequestFields`` (model, messages/prompt, max_tokens, stream, tools, the
  client's ``cache_salt``) parsed from the raw body, a 400 naming the field when malformed.
- ``body_checks.py``: the type and range checks ``fields.py`` applies (OpenAI's limits).
- ``image_parts.py``: chat messages' image parts (data URLs decoded and sniffed, counted, and
  the messages as a chat template takes them).

May import: ``portico/`` (errors, the engine-hop contract) and nothing else of the gateway;
every wing reads requests through it (tests/gateway/test_import_rules.py).
"""
