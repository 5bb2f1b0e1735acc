"""What a result says about the run: the code that ran (git revision, a digest of the
sources) and the model's shape as a reader should see it named.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


# The checkout (or site-packages) the package runs from: git and the source digest read it.
ROOT = Path(__file__).resolve().parent.parent.parent


def model_shape_name(args) -> str:
    """The model as a reader should see it named: its shape and weights, or its directory's name."""
    from hybridd.bench.random_checkpoint import SHAPE_NAMES, describe

    dtype = "bf16" if args.device == "cuda" else "float32"
    if args.model is not None:
        return f"{describe(args.model)} ({dtype})"
    return f"{SHAPE_NAMES.get(args.preset, args.preset)} shape, random {dtype} weights"


def git_rev() -> str | None:
    """HEAD, with `-dirty` when the tree has changes (a copy of a working tree can carry
    an older .git than its files: `source_digest` names the code itself)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT,
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


SOURCE_DIRS = ("hybridd", "workers", "ipc", "protocol", "scripts")


def source_digest() -> str:
    """SHA-256 (first 12 hex digits) of the Python sources that ran, paths and contents:
    the same code gives the same digest wherever it was copied."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]
