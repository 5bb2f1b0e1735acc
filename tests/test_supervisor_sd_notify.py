"""sd_notify over real unix datagram sockets: a path, the abstract namespace, and no socket."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from hybridd.sd_notify import MAX_STATUS_CHARS, Notifier, watchdog_interval_s


def _listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)
    sock.settimeout(2)
    return sock


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_messages_arrive_as_sent(tmp_path: Path, abstract: bool):
    address = f"@hybridd-notify-test-{os.getpid()}" if abstract else str(tmp_path / "notify")
    listener = _listener(address)
    notifier = Notifier(address)
    try:
        assert notifier.enabled
        assert notifier.status("capturing decode graphs 5/9")
        assert listener.recv(4096) == b"STATUS=capturing decode graphs 5/9"
        assert notifier.ready("ready")
        assert listener.recv(4096) == b"READY=1\nSTATUS=ready"
        assert notifier.watchdog()
        assert listener.recv(4096) == b"WATCHDOG=1"
        assert notifier.stopping("draining\nnow")
        assert listener.recv(4096) == b"STOPPING=1\nSTATUS=draining now"  # one line per field
        notifier.status("x" * (MAX_STATUS_CHARS + 10))
        assert listener.recv(8192) == b"STATUS=" + b"x" * MAX_STATUS_CHARS
    finally:
        notifier.close()
        listener.close()


def test_environment_selects_the_socket(tmp_path: Path, monkeypatch):
    address = str(tmp_path / "env-notify")
    listener = _listener(address)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    notifier = Notifier()
    assert notifier.status("from the environment")
    assert listener.recv(4096) == b"STATUS=from the environment"
    notifier.close()
    listener.close()


def test_without_systemd_everything_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    assert notifier.ready("ready") is False
    assert notifier.watchdog() is False


def test_a_vanished_listener_does_not_raise(tmp_path: Path):
    address = str(tmp_path / "gone")
    _listener(address).close()
    os.unlink(address)
    notifier = Notifier(address)
    assert notifier.status("nobody listens") is False
    notifier.close()


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert watchdog_interval_s() is None
