"""scripts/bench_step_launch.py: bad arguments are refused by name, and without CUDA it
says that it needs a device instead of failing somewhere inside."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.host_load import on_this_host

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_step_launch.py"


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=on_this_host(120))


@pytest.mark.parametrize("args, message", [
    (["--idle-ms", "one"], "--idle-ms"),
    (["--idle-ms", "-1"], "--idle-ms"),
    (["--kernels", "9"], "--kernels"),
    (["--kernels", "many"], "--kernels"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, args, message):
    done = run(["--out", str(tmp_path / "x.json"), *args])
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_without_cuda_it_says_it_needs_a_device(tmp_path):
    done = run(["--out", str(tmp_path / "x.json")])
    assert done.returncode == 1
    assert "needs a CUDA device" in done.stderr
    assert not (tmp_path / "x.json").exists()
