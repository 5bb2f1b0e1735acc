"""The private MPS daemon of `cuda_mps` ("auto" by default, "on", "off"): which setting
starts it where, its errors everywhere, and on the GPU machine the daemon serving
through it and quitting it on stop."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from hybridd import Client, exit_codes
from hybridd.config import Config, ConfigError
from hybridd.cuda_mps import CONTROL_BINARY, MpsDaemon, MpsError, start_for
from tests.daemon import wait_until_ok

ROOT = Path(__file__).resolve().parent.parent


def _start(runtime_dir: Path, *flags: str, log) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDD_", "CUDA_MPS_")) and k != "NOTIFY_SOCKET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", "hybridd.cli", "start", "--runtime-dir", str(runtime_dir),
                             "--no-compile-sampler", "--log-level", "warning", *flags],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def test_setting_is_validated():
    with pytest.raises(ConfigError, match="cuda_mps must be auto, on or off, got 'yes'"):
        Config(cuda_mps="yes").validate()
    with pytest.raises(ConfigError, match="cuda_mps = on needs a CUDA device, but device is cpu"):
        Config(cuda_mps="on", device="cpu").validate()
    Config(cuda_mps="auto", device="cpu").validate()  # auto on the CPU: simply no MPS
    assert Config().cuda_mps == "auto"
    with pytest.raises(ValueError, match="cuda_mps must be one of auto, on, off, got 'yes'"):
        start_for("yes", "cuda", Path("/nonexistent"))


def test_which_settings_start_no_daemon(tmp_path):
    """None of these starts a daemon, and each says why, as `hybridd status` shows it."""
    assert start_for("off", "cuda", tmp_path) == (None, "off (cuda_mps = off)")
    assert start_for("auto", "cpu", tmp_path) == (None, "off (CPU device)")
    assert start_for("auto", "cuda", tmp_path, binary="nvidia-cuda-mps-control-absent") == (
        None, "off (nvidia-cuda-mps-control-absent is not on PATH)")
    assert not (tmp_path / "mps").exists()  # nothing was even attempted
    with pytest.raises(MpsError, match="needs nvidia-cuda-mps-control-absent"):
        start_for("on", "cuda", tmp_path, binary="nvidia-cuda-mps-control-absent")


def test_auto_goes_on_without_a_control_daemon_that_does_not_start(tmp_path):
    """An installed but broken MPS (a control binary that exits 1): "auto" serves
    without it, "on" refuses with the binary's own words."""
    binary = tmp_path / "broken-mps-control"
    binary.write_text("#!/bin/sh\necho 'mps: no devices to serve' >&2\nexit 1\n")
    binary.chmod(0o755)
    daemon, status = start_for("auto", "cuda", tmp_path / "run", binary=str(binary))
    assert daemon is None and status.startswith("unavailable (") and "mps: no devices to serve" in status
    with pytest.raises(MpsError, match="exit 1.*mps: no devices to serve"):
        start_for("on", "cuda", tmp_path / "run", binary=str(binary))


def test_missing_control_binary_is_named(tmp_path):
    with pytest.raises(MpsError, match="needs nvidia-cuda-mps-control-absent .* set cuda_mps"):
        MpsDaemon(tmp_path, binary="nvidia-cuda-mps-control-absent").start()


@pytest.mark.skipif(shutil.which(CONTROL_BINARY) is not None, reason="the control binary is installed here")
def test_start_refuses_cleanly_without_mps(tmp_path):
    """On a CUDA host without the MPS control binary, `cuda_mps = "on"` is refused by name;
    on a host without a usable CUDA device the device preflight refuses first (exit 2)."""
    runtime_dir = tmp_path / "run"
    with open(tmp_path / "log", "wb") as log:
        process = _start(runtime_dir, "--device", "cuda", "--cuda-mps", "on", log=log)
        code = process.wait(120)
    output = (tmp_path / "log").read_text()
    if torch.cuda.is_available():
        assert code == 1, output
        assert f"hybridd: cannot start: cuda_mps = \"on\" needs {CONTROL_BINARY}" in output
    else:
        assert code == exit_codes.USAGE, output
        assert "device cuda: no usable CUDA device on this host" in output
    assert not (runtime_dir / "hybridd.pid").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which(CONTROL_BINARY) is None,
                    reason="needs CUDA and nvidia-cuda-mps-control")
@pytest.mark.parametrize("setting", ["on", "auto"])
def test_daemon_serves_through_its_own_mps_server_and_quits_it(setting):
    base = Path(tempfile.mkdtemp(prefix="hm-"))
    runtime_dir = base / "run"
    with open(base / "log", "wb") as log:
        process = _start(runtime_dir, "--device", "cuda", "--cuda-mps", setting, log=log)
    endpoint = f"ipc://{runtime_dir}/hybridd.sock"
    mps = MpsDaemon(runtime_dir)
    try:
        wait_until_ok(endpoint, 300, process)
        servers = mps.server_pids()
        assert servers, (base / "log").read_text()
        with Client(endpoint, timeout=60) as client:
            result = client.generate("ROMEO:", max_tokens=16, temperature=0.0)
            status = client.status()
        assert len(result.token_ids) == 16 and result.finish_reason == "length"
        assert status["cuda_mps"] == f"in use (pipes under {mps.pipe_dir})"
        assert mps.server_pids() == servers  # both workers are clients of that one server
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    assert code == 0, (base / "log").read_text()
    deadline = time.monotonic() + 10
    while mps.server_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mps.server_pids() == []
    assert subprocess.run([CONTROL_BINARY], input="get_server_list\n", text=True, capture_output=True, timeout=10,
                          env={**os.environ, **mps.env}).returncode != 0  # the control daemon is gone
