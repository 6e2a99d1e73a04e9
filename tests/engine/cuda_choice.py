"""Running a check script through the CUDA kernel choice on a CPU: a separate process with
``TRITON_INTERPRET=1`` and ``PORTICO_KERNEL_DEVICE=cuda`` (both read before triton is first
imported), whose last line of output is its JSON findings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(script: Path, *args: str, timeout: float = 900) -> Any:
    """``script args`` under the interpreted CUDA kernel choice; its last output line, parsed.
    The repository and tests/ are on its path; a failing script fails the caller's test with
    its standard error's end."""
    env = dict(os.environ, TRITON_INTERPRET="1", PORTICO_KERNEL_DEVICE="cuda")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
