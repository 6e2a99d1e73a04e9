"""The retry policy: when a failed attempt may be tried again, and how long to wait.

Policy only: the proxy owns the loop. Retries happen only before any byte reached the client,
on connect errors and on the statuses listed here (engine 429 included: another replica may
have room). The wait before attempt ``n`` (``n`` = 1 for the first retry) is drawn uniformly
from ``[0, min(max_backoff, base * 2**(n-1))]`` ("full jitter"), and no retry starts after the
overall deadline.
"""

from __future__ import annotations

import random
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field


class RetryPolicy(BaseModel):
    """Attempts, backoff and ejection numbers, loaded from ``policies/retry.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_attempts: int = Field(default=3, ge=1, le=10)
    base_backoff_s: float = Field(default=0.05, ge=0, le=10)
    max_backoff_s: float = Field(default=1.0, ge=0, le=60)
    deadline_s: float = Field(default=30.0, gt=0, le=3600)  # overall, from the first attempt
    connect_timeout_s: float = Field(default=2.0, gt=0, le=60)
    # the longest silence between bytes of an upstream answer
    read_timeout_s: float = Field(default=600.0, gt=0, le=3600)
    retry_on_status: frozenset[int] = frozenset({429, 502, 503, 504})
    # consecutive failed attempts of one replica that eject it
    eject_after_failures: int = Field(default=3, ge=1, le=100)
    eject_cooldown_s: float = Field(default=5.0, gt=0, le=3600)

    def backoff(self, retry_number: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry ``retry_number`` (1-based), full jitter."""
        cap = min(self.max_backoff_s, self.base_backoff_s * (2 ** (retry_number - 1)))
        return (rng or random).uniform(0.0, cap)

    def retries_status(self, status: int) -> bool:
        return status in self.retry_on_status


def load_retry_policy(path: Path) -> RetryPolicy:
    """Read ``retry.yaml``; a missing file gives the defaults above."""
    if not path.is_file():
        return RetryPolicy()
    data = yaml.safe_load(path.read_text()) or {}
    return RetryPolicy.model_validate(data)
