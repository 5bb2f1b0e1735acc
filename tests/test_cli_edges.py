"""What a new user meets at the command line: `hybridd status --json` prints JSON even
with no daemon, `hybridd start` refuses a CUDA device that is not there and settings
that cannot serve (one line, exit 2, no worker spawned), and Ctrl-C in `hybridd
generate` ends it with one line and exit 130.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from hybridd import exit_codes
from tests.daemon import HYBRIDD, RunningDaemon, clean_env, run_daemon
from tests.host_load import on_this_host
from tests.processes import as_from_a_terminal

# A refusal takes about a second on an idle host (a CUDA device's check imports torch).
REFUSAL_BOUND_S = 10.0


def _hybridd(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([HYBRIDD, *args], capture_output=True, text=True, timeout=timeout, env=clean_env())
    return done, time.monotonic() - started


def test_status_json_without_a_daemon_is_json_with_the_exit_code(tmp_path):
    done, _ = _hybridd("status", "--json", "--runtime-dir", str(tmp_path))
    assert done.returncode == exit_codes.NOT_RUNNING
    status = json.loads(done.stdout)
    assert status["state"] == "not running" and status["exit_code"] == exit_codes.NOT_RUNNING
    assert status["endpoint"] == f"ipc://{tmp_path}/hybridd.sock"
    assert done.stderr.startswith("hybridd is not running") and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--device", "cuda"], "device cuda: no usable CUDA device on this host"),
    (["--device", "cuda:7"], "device cuda:7: "),
    (["--num-kv-blocks", "1"], "num_kv_blocks 1 x block_size 16 = 16 tokens cannot hold one sequence of "
                               "max_model_len 1024: give num_kv_blocks >= 64"),
    (["--num-kv-blocks", "6", "--max-model-len", "100", "--max-batch", "4"],
     "cannot hold one sequence of max_model_len 100"),
    (["--num-kv-blocks", "64", "--max-batch", "100"], "max_batch 100 can never run: each sequence holds at least "
                                                      "one KV block and num_kv_blocks is 64"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_what_cannot_serve_is_refused_at_start(tmp_path, flags, message):
    if flags[0] == "--device":
        import torch

        if torch.cuda.device_count() > (0 if flags[1] == "cuda" else 7):
            pytest.skip("this host has the device")
    done, elapsed = _hybridd("start", "--runtime-dir", str(tmp_path / "run"), *flags)
    assert done.returncode == exit_codes.USAGE, done.stderr[-3000:]
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert elapsed < on_this_host(REFUSAL_BOUND_S)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_settings_that_can_serve_still_start_their_checks(tmp_path):
    """The largest refused values' neighbours pass the checks (printed, not started)."""
    done, _ = _hybridd("start", "--runtime-dir", str(tmp_path / "run"), "--num-kv-blocks", "64", "--max-batch", "64",
                       "--print-config")
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with run_daemon() as running:
        yield running


def test_ctrl_c_in_generate_exits_130_with_one_line(daemon):
    process = subprocess.Popen([HYBRIDD, "generate", "ROMEO:", "--endpoint", daemon.endpoint, "--max-tokens", "4000",
                                "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(),
                               preexec_fn=as_from_a_terminal)
    try:
        # The first streamed text is the sign that it is inside the stream.
        ready, _, _ = select.select([process.stdout], [], [], on_this_host(120))
        assert ready and process.stdout.read1(1), "no output from hybridd generate"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=on_this_host(30))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == exit_codes.INTERRUPTED, stderr.decode()
    assert stderr.decode() == "hybridd: interrupted\n"


@pytest.mark.parametrize(("uses", "capability", "refused"), [
    (["quantization fp8"], (8, 0), True),
    (["kv_cache_dtype fp8"], (8, 6), True),
    (["quantization fp8", "kv_cache_dtype fp8"], (8, 9), False),
    (["quantization fp8"], (9, 0), False),
    ([], (7, 5), False),
])
def test_fp8_on_a_gpu_without_fp8_is_refused_naming_the_setting_and_the_gpu(uses, capability, refused):
    """FP8 weights or an FP8 KV cache need FP8 E4M3 on the device (compute capability 8.9,
    Ada, and newer): on an older GPU the kernels would fail to compile in the workers, so
    the preflight refuses naming what asked for FP8 and the GPU (the CPU emulates FP8: no
    check there). The rule is checked here on each capability; `hybridd start` calls it
    with the configured device's."""
    from hybridd.preflight import PreflightError, check_fp8_capability

    if not refused:
        check_fp8_capability("cuda:0", "NVIDIA A100-SXM4-80GB", capability, uses)
        return
    with pytest.raises(PreflightError) as error:
        check_fp8_capability("cuda:0", "NVIDIA A100-SXM4-80GB", capability, uses)
    message = str(error.value)
    assert uses[0] in message and "NVIDIA A100-SXM4-80GB" in message and f"{capability[0]}.{capability[1]}" in message
    assert "8.9" in message and "\n" not in message


def test_fp8_settings_start_on_the_cpu(tmp_path):
    """On the CPU FP8 is emulated: the settings pass the preflight (printed, not started)."""
    done, _ = _hybridd("start", "--runtime-dir", str(tmp_path / "run"), "--device", "cpu", "--quantization", "fp8",
                       "--kv-cache-dtype", "fp8", "--print-config")
    assert done.returncode == 0, done.stderr
