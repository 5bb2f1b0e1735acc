"""The shipped systemd unit and example config: systemd's own verifier where it exists,
the required directives always, and the example config through the real loader."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from hybridd.cli import resolve_config

SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"
UNIT = SYSTEMD / "hybridd.service"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax: sections, repeatable keys, comments, backslash continuations."""
    sections: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        sections[section][key.strip()].append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def test_required_directives(unit):
    service = unit["Service"]
    one = {key: values[-1] for key, values in service.items()}
    assert one["Type"] == "notify"
    assert one["NotifyAccess"] == "main"
    assert one["ExecStart"] == "/usr/local/bin/hybridd start --config /etc/hybridd/hybridd.toml"
    assert int(one["TimeoutStartSec"]) >= 600
    assert int(one["WatchdogSec"]) > 0
    assert one["Restart"] == "on-failure"
    from hybridd import exit_codes

    assert sorted(int(code) for code in one["RestartPreventExitStatus"].split()) == sorted(exit_codes.PERMANENT)
    assert int(one["RestartSec"]) > 0
    assert one["KillMode"] == "mixed"
    assert one["RuntimeDirectory"] == "hybridd"
    assert one["RuntimeDirectoryMode"] == "0750"
    assert one["User"] == "hybridd" and one["Group"] == "hybridd"
    assert "DynamicUser" not in service
    assert one["NoNewPrivileges"] == "yes"
    assert one["ProtectSystem"] == "strict"
    assert one["ProtectHome"] == "yes"
    assert one["PrivateTmp"] == "yes"
    assert one["DevicePolicy"] == "closed"
    assert "MemoryDenyWriteExecute" not in service  # breaks PyTorch's JIT
    assert "/var/cache/hybridd" in one["ReadWritePaths"].split()
    allowed = {value.split()[0] for value in service["DeviceAllow"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "char-nvidia-caps", "/dev/nvidia0"} <= allowed
    unit_section = {key: values[-1] for key, values in unit["Unit"].items()}
    assert int(unit_section["StartLimitIntervalSec"]) > 0 and int(unit_section["StartLimitBurst"]) > 0
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_stop_timeout_leaves_room_for_the_drain(unit):
    config = resolve_config(str(SYSTEMD / "hybridd.toml"), {}, environ={})
    from hybridd.supervisor import DRAIN_GRACE_S

    assert int(unit["Service"]["TimeoutStopSec"][-1]) > config.drain_timeout_s + DRAIN_GRACE_S


def test_start_timeout_leaves_room_for_the_workers_start_up(unit):
    config = resolve_config(str(SYSTEMD / "hybridd.toml"), {}, environ={})
    assert int(unit["Service"]["TimeoutStartSec"][-1]) > config.startup_timeout_s


def test_example_config_loads():
    config = resolve_config(str(SYSTEMD / "hybridd.toml"), {}, environ={})
    assert config.runtime_dir == "/run/hybridd"
    assert config.client_endpoint == "ipc:///run/hybridd/hybridd.sock"
    assert config.device == "cuda:0"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path):
    # verify insists that ExecStart's binary exists: point it at the installed command.
    hybridd = Path(sys.executable).parent / "hybridd"
    text = UNIT.read_text().replace("/usr/local/bin/hybridd", str(hybridd))
    copy = tmp_path / "hybridd.service"
    copy.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # Unknown or misspelled directives are only warnings: refuse any message about the unit.
    assert [line for line in done.stderr.splitlines() if "hybridd.service" in line] == []
