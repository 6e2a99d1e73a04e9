"""What the gateway's request path pays for tracing when it is off: the no-op trace calls
(``gateway/tracing.py`` ``NO_TRACE``) one completion request makes, beside an empty function
call in the same run.

    python -m load.trace_overhead [--requests 100000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import timeit

from gateway.tracing import NO_TRACE


def request_path_calls() -> None:
    """The calls ``Gateway._complete`` makes on its trace, in order."""
    trace = NO_TRACE
    with trace.phase("authenticate"):
        pass
    began = trace.mark()
    trace.routed(began, None, None, None)  # type: ignore[arg-type]
    with trace.phase("admit"):
        pass
    with trace.current():
        pass
    trace.answered(None)  # type: ignore[arg-type]
    trace.end(None)  # type: ignore[arg-type]


def empty() -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    n = args.requests
    off = min(timeit.repeat(request_path_calls, number=n, repeat=args.repeat)) / n
    base = min(timeit.repeat(empty, number=n, repeat=args.repeat)) / n
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cost, empty_ns = (off - base) * 1e9, base * 1e9
    print(f"tracing off, per request: {cost:.0f} ns (an empty call: {empty_ns:.0f} ns)")


if __name__ == "__main__":
    main()
