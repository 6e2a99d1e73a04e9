"""Usage export: one row per tenant, API key, model and UTC day, as CSV or JSON Lines.

What a platform team bills its internal tenants from (``GET /admin/v1/usage/export``). Rows
come from the per-day usage hashes (:mod:`gateway.identity.usage`); requests no API key
accounts for (JWT or admin callers, days recorded before per-key counts existed) form a row
with an empty ``key_id``. Spend is exact: ``spend_micro_usd`` is the integer the gateway summed,
``spend_usd`` the same amount written in dollars (six decimals in CSV).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from datetime import date
from typing import Any, Literal

from gateway.identity.tenants import TenantStore
from gateway.identity.usage import check_range

ExportFormat = Literal["csv", "jsonl"]
EXPORT_COLUMNS = (
    "date",
    "tenant_id",
    "key_id",
    "model",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "spend_usd",
    "spend_micro_usd",
)
MEDIA_TYPES = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson"}
# A spreadsheet runs a cell that starts with one of these as a formula (CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


async def export_rows(
    store: TenantStore, start: date, end: date, tenant_id: str | None = None
) -> list[dict[str, Any]]:
    """The rows of ``[start, end]`` (every tenant, or only ``tenant_id``), ordered by date,
    tenant, model and key. Raises InvalidRequestError for a reversed or too long range."""
    check_range(start, end)
    if tenant_id is not None:
        tenant_ids = [(await store.require_tenant(tenant_id)).id]
    else:
        tenant_ids = [t.id for t in await store.list_tenants()]
    rows: list[dict[str, Any]] = []
    for tenant in tenant_ids:
        for day, record in await store.ledger.days(tenant, start, end):
            for key_id, model, counters in record.rows():
                rows.append(
                    {
                        "date": day.isoformat(),
                        "tenant_id": tenant,
                        "key_id": key_id,
                        "model": model,
                        "requests": counters.requests,
                        "prompt_tokens": counters.prompt_tokens,
                        "cached_tokens": counters.cached_tokens,
                        "completion_tokens": counters.completion_tokens,
                        "spend_usd": counters.spend_micro_usd / 1_000_000,
                        "spend_micro_usd": counters.spend_micro_usd,
                    }
                )
    rows.sort(key=lambda r: (r["date"], r["tenant_id"], r["model"], r["key_id"] or ""))
    return rows


def dollars(micro: int) -> str:
    """Integer micro-dollars as an exact decimal string: 1234567 -> ``1.234567``."""
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(micro), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def render(rows: Iterable[dict[str, Any]], fmt: ExportFormat) -> str:
    """The rows as CSV (a header line, then one line per row) or JSON Lines."""
    if fmt == "jsonl":
        return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(EXPORT_COLUMNS)
    for row in rows:
        cells = dict(row, spend_usd=dollars(row["spend_micro_usd"]))
        writer.writerow([_cell(cells[c]) for c in EXPORT_COLUMNS])
    return out.getvalue()
