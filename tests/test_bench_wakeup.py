"""scripts/bench_wakeup.py: its rounds schedule the real scheduler's prefill and its
figures come out per idle time; bad arguments are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.host_load import on_this_host

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_wakeup.py"


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=on_this_host(120))


def test_each_idle_time_is_timed_between_two_back_to_back_controls(tmp_path):
    out = tmp_path / "wake.json"
    done = run(["--prompt-len", "40", "--idle-ms", "1,2", "--rounds", "5", "--out", str(out)])
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["prompt_len"] == 40 and figures["rounds"] == 5
    assert [row["idle_ms"] for row in figures["rows"]] == [0.0, 1.0, 2.0, 0.0]
    for row in figures["rows"]:
        assert 0 < row["median_us"] <= row["p90_us"], row
    assert "40-token prompt" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--idle-ms", "one"], "--idle-ms"),
    (["--idle-ms", "-1"], "--idle-ms"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--prompt-len", "4096"], "--prompt-len"),
])
def test_bad_arguments_are_refused_by_name(args, message):
    done = run(args + ["--rounds", "2"])
    assert done.returncode == 2 and message in done.stderr, done.stderr
