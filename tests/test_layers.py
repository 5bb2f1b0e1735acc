"""The layer contracts of pyproject.toml ([tool.importlinter]) hold for the code as the
wheel installs it: ipc/, protocol/ and workers/ inside the one `hybridd` package, with
tests/ and scripts/ beside it (the package imports neither, the tests never import the
tools, the tools never import the tests, no circles)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def installed_layout(dest: Path) -> Path:
    """The source tree arranged as pyproject's package-dir maps it (hybridd/ipc, ...)."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, source in sorted(package_dirs.items()):
        target = dest.joinpath(*package.split("."))
        shutil.copytree(ROOT / source, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "assets"))
    for package in ("tests", "scripts"):
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.fixture
def tree(tmp_path):
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: install the dev extra (import-linter)")
    return installed_layout(tmp_path)


def test_layer_contracts_hold(tree):
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("ipc/channel.py", "from hybridd.workers import supervisor_link", "hybridd.ipc is not allowed to import hybridd.workers"),
        ("hybridd/engine/block_manager.py", "from hybridd.engine.scheduler import Scheduler", "No cycles are allowed in hybridd.engine"),
        ("hybridd/client/core.py", "import torch", "hybridd.client.core is not allowed to import torch"),
        ("hybridd/kernels/pdl.py", "from hybridd.model import config", "hybridd.kernels is not allowed to import hybridd.model"),
        ("hybridd/stats.py", "from tests import host_load", "hybridd is not allowed to import tests"),
        ("hybridd/log.py", "from scripts import timing", "hybridd is not allowed to import scripts"),
        ("tests/test_random_checkpoint.py", "from scripts import make_random_checkpoint",
         "tests is not allowed to import scripts"),
        ("scripts/daemon.py", "from tests.daemon import run_daemon", "scripts is not allowed to import tests"),
        ("scripts/timing.py", "from scripts import bench", "No cycles are allowed in scripts"),
    ],
)
def test_a_wrong_import_breaks_a_contract(tree, module, line, contract):
    installed = tree / module if module.startswith(("hybridd/", "tests/", "scripts/")) else tree / "hybridd" / module
    installed.write_text(installed.read_text() + f"\n{line}\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert contract in result.stdout, result.stdout
