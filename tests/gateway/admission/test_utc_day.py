"""utc_day (formatted once per day) names the same UTC date as gmtime, at day edges too."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.spend import utc_day


@given(st.floats(min_value=0, max_value=4_102_444_800, allow_nan=False))
def test_utc_day_is_gmtimes_date(epoch_s: float) -> None:
    t = time.gmtime(epoch_s)
    assert utc_day(epoch_s) == f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}"


def test_the_day_turns_at_midnight_utc() -> None:
    midnight = 1_764_979_200  # 2025-12-06 00:00:00 UTC
    assert utc_day(midnight - 0.001) == "2025-12-05"
    assert utc_day(midnight) == "2025-12-06"
    assert utc_day(951_782_400 + 86_400) == "2000-03-01"  # past a leap day
