"""Every tool the product's docstrings and the user docs name by path (`scripts/….py`,
`scripts/….sh`) is in the tree: an experiment removed from scripts/ is pointed to in the
lab notebook instead, where its command stands with the commit it ran at."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"scripts/[A-Za-z0-9_]+\.(?:py|sh)")
READERS = ["hybridd", "workers", "ipc", "protocol", "README.md", "docs/design.md", "docs/performance.md",
           "protocol/SPEC.md", "systemd"]


def _files():
    for reader in READERS:
        path = ROOT / reader
        yield from (sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md", ".toml", ".service"))
                    if path.is_dir() else [path])


def test_every_named_tool_exists():
    missing = [f"{path.relative_to(ROOT)}: {name}" for path in _files()
               for name in NAMED.findall(path.read_text(errors="replace")) if not (ROOT / name).exists()]
    assert not missing, "named tools that are not in scripts/:\n" + "\n".join(missing)
