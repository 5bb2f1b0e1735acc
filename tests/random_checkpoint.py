"""Random checkpoints of a real model's shape for the GPU tests, written by the tool
users run (`python -m hybridd.bench.random_checkpoint`), in a subprocess; reused when
already on disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_checkpoint(out: Path, preset: str, init: str = "normal", device: str | None = None,
                    predictable: bool = False) -> Path:
    """The checkpoint of `preset` under `out` (written unless it is there already)."""
    command = [sys.executable, "-m", "hybridd.bench.random_checkpoint", "--preset", preset, "--out", str(out),
               "--init", init, *(["--predictable"] if predictable else [])]
    if device is not None:
        command += ["--device", device]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hybridd.bench.random_checkpoint --preset {preset} failed:\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def describe(model_dir: Path) -> str:
    """How the tool names `model_dir` in tables."""
    proc = subprocess.run([sys.executable, "-m", "hybridd.bench.random_checkpoint", "--describe", str(model_dir)],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return proc.stdout.strip()
