"""The wire tools (scripts/fuzz_wire.py, scripts/load_wire.py) run as a user runs them,
`python -m scripts.NAME`, in a subprocess: their JSON report and exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.host_load import on_this_host

ROOT = Path(__file__).resolve().parent.parent


def run_tool(name: str, *args: str, timeout: float = 600.0) -> tuple[int, dict]:
    """(exit status, the JSON report it printed) of `python -m scripts.NAME ARGS`."""
    proc = subprocess.run([sys.executable, "-m", f"scripts.{name}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=on_this_host(timeout))
    start = proc.stdout.find("{")
    if start < 0:
        raise AssertionError(f"scripts.{name} printed no report (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.returncode, json.loads(proc.stdout[start:])
