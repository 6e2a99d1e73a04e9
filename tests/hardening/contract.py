"""Run schemathesis over a live server's OpenAPI document and collect every broken promise.

The document is the contract; the server is a real process. Each operation gets a bounded
number of generated requests, valid ones (``positive``) and ones the schema forbids
(``negative``), and every response is checked: never a 5xx, a status the document lists, a
documented content type, a body that matches the documented schema. Failures are collected
(not raised at the first) so one run names every operation that breaks the contract.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def contract_failures(
    document_url: str,
    *,
    base_url: str,
    headers: dict[str, str],
    max_examples: int,
    skip: Callable[[str], bool] = lambda label: False,
    modes: tuple[GenerationMode, ...] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
) -> tuple[list[str], Counter[str]]:
    """(one line per broken promise, responses counted as "METHOD /path STATUS")."""
    document = httpx.get(document_url, headers=headers, timeout=30)
    document.raise_for_status()
    schema = schemathesis.openapi.from_dict(document.json())
    failures: list[str] = []
    statuses: Counter[str] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        if skip(operation.label):
            continue
        for mode in modes:
            _exercise(operation, mode, base_url, headers, max_examples, failures, statuses)
    return failures, statuses


def _exercise(
    operation: Any,
    mode: GenerationMode,
    base_url: str,
    headers: dict[str, str],
    max_examples: int,
    failures: list[str],
    statuses: Counter[str],
) -> None:
    """Up to ``max_examples`` generated requests to one operation, every response checked."""
    label = operation.label

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,  # the same requests on every run: a failure reproduces
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def exercise(case: Any) -> None:
        try:
            response = case.call(base_url=base_url, headers=headers, timeout=60)
            statuses[f"{label} {response.status_code}"] += 1
            case.validate_response(response, checks=CHECKS)
        except AssertionError as exc:  # schemathesis' FailureGroup is one
            first = str(exc).strip().splitlines()
            failures.append(f"{label} [{mode.value}]: {' | '.join(first[:6])}")

    try:
        exercise()
    except Unsatisfiable:
        pass  # e.g. no request a GET without parameters could get wrong
