"""Every setting and environment variable is declared once, and what a user reads
about them comes from that declaration: `hybridd start --help`, the example
`systemd/hybridd.toml` and the README's settings tables. Only hybridd/environment.py
reads the process environment."""

from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from hybridd import environment, settings_docs
from hybridd.cli import main, resolve_config
from hybridd.config import SECTIONS, Config, declarations, default_of, describe_allowed, describe_default, kind_of

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("hybridd", "ipc", "protocol", "workers")  # the package as pyproject's package-dir maps it
ENVIRONMENT_MODULE = ROOT / "hybridd" / "environment.py"


def _squash(text: str) -> str:
    # click wraps help text at its own width, hyphenated words included.
    return re.sub(r"\s+", "", text)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_every_setting_is_declared():
    assert len(declarations()) == len(dataclasses.fields(Config))
    defaults = Config().validate()  # the declared defaults are valid settings
    for f, declared in declarations():
        assert declared.section in SECTIONS, f.name
        assert declared.meaning.endswith(".") and len(declared.meaning) > 20, f.name
        if declared.choices:
            assert getattr(defaults, f.name) in declared.choices, f.name
    sections = [declared.section for _, declared in declarations()]
    assert sections == sorted(sections, key=list(SECTIONS).index), "a section's settings stand together"


def test_help_lists_every_setting_with_its_default_unit_and_allowed_values():
    result = CliRunner().invoke(main, ["start", "--help"])
    assert result.exit_code == 0, result.output
    text = _squash(result.output)
    for title, _ in SECTIONS.values():
        assert _squash(f"{title} settings:") in text
    starts = []
    for f, _ in declarations():
        found = re.search(r"^  " + re.escape(_flag(f.name)) + r"[ /\n]", result.output, re.M)
        assert found, f"--help does not list {_flag(f.name)}"
        starts.append((found.start(), f))
    starts.sort(key=lambda item: item[0])
    assert [f.name for _, f in starts] == [f.name for f, _ in declarations()]
    for i, (start, f) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(result.output)
        entry = _squash(result.output[start:end])
        declared = f.metadata["setting"]
        assert _squash(declared.meaning) in entry, f.name
        assert _squash(f"default: {describe_default(f)}") in entry, f.name
        if declared.unit:
            assert _squash(f"unit: {declared.unit}") in entry, f.name
        if declared.choices:
            assert "[" + "|".join(declared.choices) + "]" in entry, f.name
        elif kind_of(f) == "true or false":
            assert _squash(f"--no-{_flag(f.name)[2:]}") in entry, f.name
        elif describe_allowed(f) not in ("a file", "a directory"):  # those show as PATH
            assert _squash(describe_allowed(f)) in entry, f.name


def test_the_help_takes_its_allowed_values_from_the_kernels():
    from hybridd.kernels import gemm_fusions

    result = CliRunner().invoke(main, ["start", "--help"])
    assert _squash(", ".join(gemm_fusions.KNOWN)) in _squash(result.output)


def _toml_assignments(text: str) -> dict[str, tuple[bool, str]]:
    """name → (commented out, the `name = value` text) for each setting line of the file."""
    found: dict[str, tuple[bool, str]] = {}
    for line in text.splitlines():
        match = re.match(r"^(# )?([a-z0-9_]+) = (.*)$", line)
        if match:
            commented, name, rest = match.groups()
            assert name not in found, f"{name} appears twice"
            value = rest.split("   # ")[0] if commented else rest
            found[name] = (bool(commented), f"{name} = {value}")
    return found


def test_the_example_toml_shows_every_setting_with_its_true_default():
    path = ROOT / "systemd" / "hybridd.toml"
    text = path.read_text()
    assignments = _toml_assignments(text)
    prose = " ".join(" ".join(line.removeprefix("#").split()) for line in text.splitlines())
    assert set(assignments) == {f.name for f in dataclasses.fields(Config)}, "missing or stale settings"
    for f, _ in declarations():
        commented, line = assignments[f.name]
        if commented:
            assert tomllib.loads(line)[f.name] == default_of(f), line
        else:
            assert f.name in settings_docs.SERVICE_CHOICES, f"{f.name} is set but is no choice of the service"
            assert f"Default: {describe_default(f)}." in prose, f.name
    config = resolve_config(str(path), {}, environ={})
    assert {name: getattr(config, name) for name in settings_docs.SERVICE_CHOICES} == settings_docs.SERVICE_CHOICES
    assert text == settings_docs.example_toml(), "regenerate: python -m hybridd.settings_docs --write"


def test_the_readme_tables_hold_every_setting_and_variable():
    readme = (ROOT / "README.md").read_text()
    block = settings_docs.readme_block(readme)
    assert block is not None, "README.md has no settings block"
    rows = {}
    for line in block.splitlines():
        match = re.match(r"^\| `([A-Za-z0-9_]+)` \| ([^|]*) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    settings = {f.name: f for f in dataclasses.fields(Config)}
    named = {name for name in rows if name in settings or name in environment.VARIABLES}
    assert named == set(rows), f"stale rows: {set(rows) - named}"
    for name, f in settings.items():
        assert rows.get(name) == describe_default(f), name
    assert set(environment.VARIABLES) <= set(rows)
    assert block == settings_docs.readme_settings(), "regenerate: python -m hybridd.settings_docs --write"


def _package_sources() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _reads_environment(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("os", "posix") \
                and node.attr in ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "posix") and any(
                alias.name in ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")
                for alias in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_environment_module_reads_the_environment():
    offenders = {}
    for path in _package_sources():
        if path == ENVIRONMENT_MODULE:
            continue
        lines = _reads_environment(ast.parse(path.read_text(), str(path)))
        if lines:
            offenders[str(path.relative_to(ROOT))] = lines
    assert offenders == {}, "read the environment through hybridd/environment.py"
    assert _reads_environment(ast.parse(ENVIRONMENT_MODULE.read_text()))  # the scan sees a read where there is one


def test_every_declared_variable_is_read_somewhere():
    strings = set()
    for path in _package_sources():
        if path != ENVIRONMENT_MODULE:
            strings |= {node.value for node in ast.walk(ast.parse(path.read_text()))
                        if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert set(environment.VARIABLES) - strings == set(), "declared but read nowhere"


def test_a_read_of_an_undeclared_variable_is_refused():
    with pytest.raises(LookupError, match="HYBRIDD_NOT_DECLARED is not a declared environment variable"):
        environment.get("HYBRIDD_NOT_DECLARED")
    with pytest.raises(LookupError, match="not as a flag"):
        environment.flag("HYBRIDD_TRACE_STEPS")


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("HYBRIDD_TRACE_MARKS", "1", True), ("HYBRIDD_TRACE_MARKS", "off", False), ("HYBRIDD_TRACE_MARKS", "", False),
    ("HYBRIDD_TRACE_KERNELS", "", True), ("HYBRIDD_TRACE_KERNELS", "0", False),
    ("HYBRIDD_TRACE_WARMUP", "7", 7), ("HYBRIDD_TRACE_WARMUP", "", 100), ("HYBRIDD_TEST_SLOW_LOAD_S", "0.5", 0.5),
])
def test_declared_variables_read_as_their_type(monkeypatch, name, value, expected):
    monkeypatch.setenv(name, value)
    read = environment.flag if environment.VARIABLES[name].type is bool else environment.number
    assert read(name) == expected


@pytest.mark.parametrize(("name", "value", "message"), [
    ("HYBRIDD_TRACE_MARKS", "maybe", "HYBRIDD_TRACE_MARKS must be one of 1, true, yes, on, 0, false, no, off, "
                                     "got 'maybe'"),
    ("HYBRIDD_TRACE_WARMUP", "ten", "HYBRIDD_TRACE_WARMUP must be a whole number, got 'ten'"),
    ("HYBRIDD_TEST_SLOW_LOAD_S", "slow", "HYBRIDD_TEST_SLOW_LOAD_S must be a number, got 'slow'"),
])
def test_a_bad_value_names_its_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    read = environment.flag if environment.VARIABLES[name].type is bool else environment.number
    with pytest.raises(environment.EnvironmentVariableError, match=re.escape(message)):
        read(name)


def test_declared_variables_are_not_taken_for_settings(tmp_path):
    declared = {name: "1" for name, v in environment.VARIABLES.items() if name.startswith("HYBRIDD_") and not v.setting}
    declared["HYBRIDD_CONFIG"] = str(tmp_path / "hybridd.toml")
    (tmp_path / "hybridd.toml").write_text("max_batch = 4\n")
    assert resolve_config(None, {}, environ=declared).max_batch == 4
    with pytest.raises(ValueError, match="unknown setting HYBRIDD_TRACE_MARK$"):
        resolve_config(None, {}, environ={"HYBRIDD_TRACE_MARK": "1"})
