"""The settings' documents, made from their one declaration: the example
`systemd/hybridd.toml` and the README's "Settings" tables (settings, and the environment
variables that are not settings).

`python -m hybridd.settings_docs --write` rewrites both in a checkout after a setting or
a variable changed (hybridd/config.py, hybridd/environment.py); a test holds them to the
declaration.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from hybridd import environment
from hybridd.config import SECTIONS, declarations, default_of, describe_allowed, describe_default

# What the example service sets unlike the defaults: a real model, the systemd runtime
# directory, the first GPU. Every other line of the file is a commented default.
SERVICE_CHOICES = {
    "model": "/var/lib/hybridd/models/Llama-3.1-8B-Instruct",
    "runtime_dir": "/run/hybridd",
    "device": "cuda:0",
}
README_BEGIN = "<!-- settings: made by `python -m hybridd.settings_docs --write` from hybridd/config.py and " \
               "hybridd/environment.py; edit those -->"
README_END = "<!-- end of settings -->"
TOML_WIDTH = 90

_TOML_HEADER = """\
# hybridd configuration (/etc/hybridd/hybridd.toml). Every setting can also be given
# as an environment variable HYBRIDD_<NAME> or a flag --<name> (flags win, then the
# environment, then this file). `hybridd start --config FILE --print-config` shows
# the result; `hybridd start --help` lists the same settings.
#
# A commented line shows a setting's default; the lines that are not commented are this
# service's own choices. Made by `python -m hybridd.settings_docs --write` from
# hybridd/config.py.
"""


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, TOML_WIDTH - 2, initial_indent="# ", subsequent_indent="# ",
                         break_on_hyphens=False)


def example_toml() -> str:
    lines = _TOML_HEADER.splitlines()
    section = None
    for f, declared in declarations():
        if declared.section != section:
            section = declared.section
            title, intro = SECTIONS[section]
            lines += ["", f"# ---- {title}"] + (_comment(intro) if intro else [])
        lines.append("")
        facts = [f"Allowed: {describe_allowed(f)}."]
        if declared.unit:
            facts.append(f"Unit: {declared.unit}.")
        if f.name in SERVICE_CHOICES:
            facts.append(f"Default: {describe_default(f)}.")
            assignment = f"{f.name} = {json.dumps(SERVICE_CHOICES[f.name])}"
        else:
            assignment = f"# {f.name} = {json.dumps(default_of(f))}"
            if declared.default_text:
                assignment += f"   # {declared.default_text}"
        lines += _comment(f"{declared.meaning} {' '.join(facts)}") + [assignment]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def readme_settings() -> str:
    """The README's block between its markers: the settings table and the variables table."""
    lines = [README_BEGIN, "",
             "| Setting | Default | Unit | Allowed | Meaning |",
             "|---|---|---|---|---|"]
    section = None
    for f, declared in declarations():
        if declared.section != section:
            section = declared.section
            lines.append(f"| **{SECTIONS[section][0]}** | | | | |")
        lines.append(f"| `{f.name}` | {_cell(describe_default(f))} | {declared.unit or '-'} | "
                     f"{_cell(describe_allowed(f))} | {_cell(declared.meaning)} |")
    lines += ["", "Environment variables that are not settings (`HYBRIDD_TEST_*` belong to the test suite):", "",
              "| Variable | Type | Default | Meaning |",
              "|---|---|---|---|"]
    for variable in environment.VARIABLES.values():
        if variable.setting:
            default = f"the `{variable.setting}` setting's"
            kind = next(describe_allowed(f) for f, _ in declarations() if f.name == variable.setting)
        else:
            default = "unset" if variable.default is None else json.dumps(variable.default)
            kind = {str: "text", int: "integer", float: "number", bool: "1/0, true/false, yes/no, on/off"}[
                variable.type]
        lines.append(f"| `{variable.name}` | {_cell(kind)} | {default} | {_cell(variable.meaning)} |")
    return "\n".join(lines + ["", README_END])


def readme_block(readme: str) -> str | None:
    """The README's settings block as it stands, markers included (None without them)."""
    begin = readme.find(README_BEGIN)
    end = readme.find(README_END)
    if begin < 0 or end < begin:
        return None
    return readme[begin:end + len(README_END)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite systemd/hybridd.toml and the README's settings block in --root")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the checkout (default: here)")
    args = parser.parse_args()
    if not args.write:
        sys.stdout.write(example_toml() + "\n" + readme_settings() + "\n")
        return
    (args.root / "systemd" / "hybridd.toml").write_text(example_toml())
    readme_path = args.root / "README.md"
    readme = readme_path.read_text()
    block = readme_block(readme)
    if block is None:
        raise SystemExit(f"{readme_path}: no settings block ({README_BEGIN!r} … {README_END!r}) to replace")
    readme_path.write_text(readme.replace(block, readme_settings()))


if __name__ == "__main__":
    main()
