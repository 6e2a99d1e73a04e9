"""The gateway-engine contract (portico/contract.py) is one module both sides import: the
gateway loads it, and its whole request path, without the engine or torch."""

from __future__ import annotations

import subprocess
import sys

from engine.config import EngineConfig
from engine.server.shared_prefix import salt_with_prefix
from portico.contract import (
    FAIR_CONTENDED_PREFILL_TOKENS,
    FAIR_SHORT_PREFILL_TOKENS,
    SharedPrefix,
    shared_prefix_header,
    shared_prefix_of,
    with_shared_prefix,
)


def test_the_gateway_loads_the_contract_without_the_engine_or_torch() -> None:
    code = (
        "import sys, gateway.app, gateway.request_path, portico.contract\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'engine')\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == ""


def test_the_engines_fair_defaults_are_the_contracts() -> None:
    config = EngineConfig()
    assert config.fair_contended_prefill_tokens == FAIR_CONTENDED_PREFILL_TOKENS
    assert config.fair_short_prefill_tokens == FAIR_SHORT_PREFILL_TOKENS


def test_the_shared_prefix_header_the_gateway_writes_is_the_one_the_engine_reads() -> None:
    value = shared_prefix_header(42, "shared-prefix:corp;x")
    found = shared_prefix_of({"x-portico-cache-shared-prefix": value})
    assert found == SharedPrefix(42, "shared-prefix:corp;x")
    assert salt_with_prefix("t", found, [1, 2, 3], [1, 2, 9]) == with_shared_prefix(
        "t", "shared-prefix:corp;x", 2
    )
