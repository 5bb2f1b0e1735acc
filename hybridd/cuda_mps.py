"""A private CUDA MPS control daemon for the two workers (`cuda_mps`, "auto" by default).

Without MPS each worker has its own CUDA context and the GPU time-slices between
them: every step hands the GPU over twice (forward in the graph generator, sampling
in the context generator), and each hand-over leaves the GPU idle while it switches
contexts, on the path of every token. It also hides the gain of programmatic dependent
launch, which reaches the client only under MPS (docs/lab/design_choices.md, "Two CUDA
contexts cost two context switches per step"). Under MPS both processes' work goes
through one server context.

"auto" starts the daemon for a CUDA device when `nvidia-cuda-mps-control` is on PATH,
and runs without MPS (saying why in the log) when it is not there or does not start;
"on" refuses to start without it; "off" never starts it.

The supervisor starts the daemon with its pipe and log directories inside the
runtime directory, so it serves hybridd's workers only and no other GPU client is
affected, passes those directories to the workers through the environment, and
quits it on every exit path.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from hybridd import environment
from hybridd.log import get_logger

log = get_logger("cuda_mps")

CONTROL_BINARY = "nvidia-cuda-mps-control"
COMMAND_TIMEOUT_S = 10.0


MODES = ("auto", "on", "off")


def start_for(mode: str, device: str, runtime_dir: Path,
              binary: str = CONTROL_BINARY) -> tuple[MpsDaemon | None, str]:
    """The private MPS daemon that `cuda_mps = mode` asks for on `device`, started (None
    where there is none), and what `hybridd status` says of it. "on" raises MpsError
    when it cannot start; "auto" then goes on without it."""
    if mode not in MODES:
        raise ValueError(f"cuda_mps must be one of {', '.join(MODES)}, got {mode!r}")
    if device == "cpu":  # "on" with the CPU is refused by Config.validate
        return None, "off (CPU device)"
    if mode == "off":
        return None, "off (cuda_mps = off)"
    if mode == "auto" and shutil.which(binary) is None:
        reason = f"{binary} is not on PATH"
        log.info("mps_off", reason=reason)
        return None, f"off ({reason})"
    daemon = MpsDaemon(runtime_dir, binary)
    try:
        daemon.start()
    except MpsError as error:
        if mode == "on":
            raise
        log.warning("mps_unavailable", error=str(error), consequence="the workers time-slice the GPU",
                    hint='set cuda_mps = "off" to run without MPS and without this attempt')
        return None, f"unavailable ({error})"
    return daemon, f"in use (pipes under {daemon.pipe_dir})"


class MpsError(RuntimeError):
    """The MPS daemon could not be started (the message says why and what to do)."""


class MpsDaemon:
    def __init__(self, runtime_dir: Path, binary: str = CONTROL_BINARY):
        self.pipe_dir = Path(runtime_dir) / "mps"
        self.log_dir = Path(runtime_dir) / "mps-log"
        self.binary = binary
        self.running = False

    @property
    def env(self) -> dict[str, str]:
        """What a CUDA process needs in its environment to be a client of this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def start(self) -> None:
        path = shutil.which(self.binary)
        if path is None:
            raise MpsError(
                f"cuda_mps = \"on\" needs {self.binary} (part of the NVIDIA driver) on PATH; "
                "install it, or set cuda_mps = \"off\""
            )
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        result = self._control(path, None, "-d")
        if result.returncode != 0:
            raise MpsError(f"{self.binary} -d failed (exit {result.returncode}): {self._log_tail(result)}")
        self.running = True
        # The daemon is up once it answers a command on its pipe.
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:
            probe = self._control(path, "get_server_list")
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline:
                self.stop()
                raise MpsError(f"the MPS control daemon did not answer within {COMMAND_TIMEOUT_S:.0f} s: "
                               f"{self._log_tail(probe)}")
            time.sleep(0.05)
        log.info("mps_started", pipe_dir=str(self.pipe_dir))

    def server_pids(self) -> list[int]:
        """PIDs of the MPS servers the daemon runs (one once a client has connected)."""
        path = shutil.which(self.binary)
        if path is None or not self.pipe_dir.is_dir():
            return []
        result = self._control(path, "get_server_list")
        if result.returncode != 0:
            return []
        return [int(word) for word in result.stdout.split() if word.isdigit()]

    def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        path = shutil.which(self.binary)
        if path is None:
            return
        result = self._control(path, "quit")
        if result.returncode != 0:
            log.warning("mps_quit_failed", error=self._log_tail(result))
        else:
            log.info("mps_stopped")

    def _control(self, path: str, command: str | None, *args: str) -> subprocess.CompletedProcess:
        env = environment.for_child(self.env)
        try:
            return subprocess.run([path, *args], input=None if command is None else command + "\n", env=env,
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 124, stdout="", stderr=f"timed out after {exc.timeout} s")

    def _log_tail(self, result: subprocess.CompletedProcess) -> str:
        text = (result.stderr or result.stdout or "").strip()
        control_log = self.log_dir / "control.log"
        if control_log.is_file():
            text += " | control.log: " + " / ".join(control_log.read_text(errors="replace").splitlines()[-3:])
        return text[-600:] or "no output"
