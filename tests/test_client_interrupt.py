"""Ctrl-C in a program that streams from the real daemon inside `with hybridd.Client()`:
the program ends with `KeyboardInterrupt` alone, whatever the client was doing when the
signal came (most often asleep on the reply ring's bell), not with a chained traceback
from closing the client."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from hybridd.ipc import reply_ring
from tests.daemon import RunningDaemon, clean_env, run_daemon
from tests.host_load import on_this_host
from tests.processes import as_from_a_terminal

# Streams until interrupted; says so once its replies come by the reply ring.
PROGRAM = textwrap.dedent("""
    import sys

    import hybridd

    with hybridd.Client(sys.argv[1], timeout=600) as client:
        said = False
        while True:
            for chunk in client.stream("ROMEO:", max_tokens=4000, ignore_eos=True):
                if not said and client._session.ring_attached:
                    print("streaming", flush=True)
                    said = True
""")


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with run_daemon() as running:
        yield running


def interrupted(daemon: RunningDaemon, attempt: int) -> subprocess.CompletedProcess:
    program = subprocess.Popen([sys.executable, "-c", PROGRAM, daemon.endpoint], env=clean_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=as_from_a_terminal)
    try:
        line = program.stdout.readline()  # the program is inside its loop, by the ring
        assert line == "streaming\n", f"attempt {attempt}: {line!r}\n{program.stderr.read() if program.poll() else ''}"
        program.send_signal(signal.SIGINT)
        _, stderr = program.communicate(timeout=on_this_host(60))
    finally:
        if program.poll() is None:
            program.kill()
            program.wait()
    return subprocess.CompletedProcess(program.args, program.returncode, "", stderr)


@pytest.mark.skipif(not reply_ring.supported(), reason="the reply ring needs x86-64")
def test_ctrl_c_in_a_streaming_loop_raises_keyboard_interrupt_alone(daemon):
    for attempt in range(3):
        outcome = interrupted(daemon, attempt)
        # An uncaught KeyboardInterrupt ends Python by the signal itself (as a shell expects).
        assert outcome.returncode == -signal.SIGINT, (attempt, outcome.returncode, outcome.stderr)
        lines = outcome.stderr.strip().splitlines()
        assert lines[-1] == "KeyboardInterrupt", (attempt, outcome.stderr)
        assert "During handling" not in outcome.stderr and "BufferError" not in outcome.stderr, \
            (attempt, outcome.stderr)
        assert outcome.stderr.count("Traceback") == 1, (attempt, outcome.stderr)
