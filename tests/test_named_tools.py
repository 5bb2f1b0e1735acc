"""Every tool the product's docstrings, the user docs and the GPU scripts name, by path
(`scripts/….py`, `hybridd/bench/….py`) or as a module run (`python -m scripts.NAME`,
`python -m hybridd.bench.NAME`), is in the tree: an experiment removed from scripts/ is
pointed to in the lab notebook instead, where its command stands with the commit it ran at."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"(?:scripts|hybridd/bench)/[A-Za-z0-9_]+\.(?:py|sh)")
MODULE_RUN = re.compile(r"-m ((?:scripts|hybridd)(?:\.[A-Za-z0-9_]+)*)")
READERS = ["hybridd", "workers", "ipc", "protocol", "scripts", "README.md", "docs/design.md", "docs/performance.md",
           "protocol/SPEC.md", "systemd", "Makefile", "docs/lab/gpu_pending.sh"]
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _files():
    for reader in READERS:
        path = ROOT / reader
        yield from (sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md", ".toml", ".service", ".sh"))
                    if path.is_dir() else [path])


def module_source(module: str) -> Path:
    """Where `python -m MODULE` finds its code in the checkout (hybridd.ipc is ipc/, ...)."""
    parts = module.split(".")
    for depth in (2, 1):
        if ".".join(parts[:depth]) in PACKAGE_DIRS:
            base = ROOT / PACKAGE_DIRS[".".join(parts[:depth])]
            return base.joinpath(*parts[depth:])
    return ROOT.joinpath(*parts)


def _runnable(module: str) -> bool:
    source = module_source(module)
    return source.with_suffix(".py").is_file() or (source / "__main__.py").is_file()


def test_every_named_tool_exists():
    texts = {path.relative_to(ROOT): path.read_text(errors="replace") for path in _files()}
    missing = [f"{path}: {name}" for path, text in texts.items() for name in NAMED.findall(text)
               if not (ROOT / name).exists()]
    missing += [f"{path}: -m {module}" for path, text in texts.items() for module in MODULE_RUN.findall(text)
                if not _runnable(module)]
    assert not missing, "named tools that are not in the tree:\n" + "\n".join(missing)


def test_a_module_run_is_found_where_the_wheel_maps_it():
    assert _runnable("hybridd.bench") and _runnable("hybridd.bench.random_checkpoint")
    assert _runnable("hybridd.protocol.codec") and not _runnable("hybridd.bench.make_random_checkpoint")
