"""The layer contracts of pyproject.toml ([tool.importlinter]) hold for the code as the
wheel installs it: ipc/, protocol/ and workers/ inside the one `hybridd` package, with
tests/ and scripts/ beside it (the package imports neither, the tests never import the
tools, the tools never import the tests, no circles); and no test reaches a tool's module
by a way import-linter cannot see (a sys.path edit, a file loader)."""

from __future__ import annotations

import ast
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
        ("hybridd/log.py", "from scripts import load_wire", "hybridd is not allowed to import scripts"),
        ("hybridd/bench/timing.py", "from scripts import fuzz_wire", "hybridd is not allowed to import scripts"),
        ("hybridd/bench/daemon.py", "from tests.daemon import run_daemon", "hybridd is not allowed to import tests"),
        ("hybridd/bench/timing.py", "from hybridd import cli", "hybridd.bench is not allowed to import hybridd.cli"),
        ("tests/test_random_checkpoint.py", "from scripts import trace_requests",
         "tests is not allowed to import scripts"),
        ("scripts/load_wire.py", "from tests.daemon import run_daemon", "scripts is not allowed to import tests"),
        ("hybridd/bench/timing.py", "from hybridd.bench import cli", "No cycles are allowed in hybridd.bench"),
    ],
)
def test_a_wrong_import_breaks_a_contract(tree, module, line, contract):
    installed = tree / module if module.startswith(("hybridd/", "tests/", "scripts/")) else tree / "hybridd" / module
    installed.write_text(installed.read_text() + f"\n{line}\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert contract in result.stdout, result.stdout


SCRIPT_MODULES = frozenset(path.stem for path in (ROOT / "scripts").glob("*.py")) - {"__init__"}
LOADERS = frozenset({"spec_from_file_location", "SourceFileLoader", "run_path", "import_module", "__import__",
                     "run_module", "syspath_prepend"})


def _names_a_script(name: str) -> bool:
    top = name.split(".")[0]
    return top == "scripts" or top in SCRIPT_MODULES


def _mentions_scripts(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str)
               and (n.value == "scripts" or "scripts/" in n.value or _names_a_script(n.value))
               for n in ast.walk(node))


def _is_sys_path(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def reaches_scripts(source: str) -> list[str]:
    """Where test code reaches a module of scripts/ other than by running it: an import of
    `scripts` or of a module by a scripts file's name, any edit of sys.path, a module
    loaded from a path or name that names scripts. (Running a tool in a subprocess is fine.)"""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if _names_a_script(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _names_a_script(node.module):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value):
            found.append(f"line {node.lineno}: sys.path.{node.func.attr}(...)")
        elif isinstance(node, (ast.Assign, ast.AugAssign)) and any(
                _is_sys_path(t) or isinstance(t, ast.Subscript) and _is_sys_path(t.value)
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            found.append(f"line {node.lineno}: sys.path assigned")
        elif isinstance(node, ast.Call) and _mentions_scripts(node):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in LOADERS:
                found.append(f"line {node.lineno}: {func}(...) of a scripts module")
    return found


def test_no_test_reaches_a_script_but_by_running_it():
    """Tests run the tools as users do (`python -m scripts.NAME` in a subprocess) and share
    with them only what the package holds: import-linter sees `import scripts...`, this
    sees the other ways in (a bare `import bench` after a sys.path edit, a file loader)."""
    found = {str(path.relative_to(ROOT)): hits for path in sorted((ROOT / "tests").rglob("*.py"))
             if (hits := reaches_scripts(path.read_text()))}
    assert found == {}


@pytest.mark.parametrize("line", [
    "import fuzz_wire as fw",
    "from load_wire import main",
    "import scripts.trace_requests",
    "from scripts import run_demo",
    "sys.path.insert(0, str(ROOT / 'scripts'))",
    "sys.path.append('/anywhere')",
    "sys.path[:0] = [str(ROOT)]",
    "spec = importlib.util.spec_from_file_location('load', ROOT / 'scripts' / 'load_wire.py')",
    "module = importlib.import_module('scripts.fuzz_wire')",
    "runpy.run_path('scripts/fuzz_wire.py')",
    "monkeypatch.syspath_prepend(str(ROOT / 'scripts'))",
])
def test_each_way_to_a_script_is_seen(line):
    assert reaches_scripts(line), line


@pytest.mark.parametrize("line", [
    "subprocess.run([sys.executable, '-m', 'scripts.fuzz_wire', '--count', '10'])",
    "from hybridd.bench.timing import ratio",
    "from tests.daemon import running",
    "spec = importlib.util.spec_from_file_location('plot', ROOT / 'docs' / 'lab' / 'benchmarks_plot.py')",
    "text = '''sys.path.insert(0, sys.argv[1])'''",
])
def test_running_a_tool_or_loading_other_files_is_not_flagged(line):
    assert reaches_scripts(line) == []
