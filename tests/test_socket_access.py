"""Who can reach the daemon: over ipc, the members of the runtime directory's group
(under systemd's UMask=0027 too) and nobody else; over TCP, CURVE clients whose key is
allowed, or any CURVE client when `curve_allow_any = true` says so explicitly.

Acting as other users needs root: the test forks and drops to unused numeric user and
group ids (permission checks need nothing else), and skips cleanly otherwise.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import sys
import traceback
from pathlib import Path

import pytest
import zmq
import zmq.auth

from hybridd.protocol import codec
from tests.daemon import free_port, run_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")


def _unused_id(taken) -> int:
    for candidate in range(61000, 65000):
        try:
            taken(candidate)
        except KeyError:
            return candidate
    raise RuntimeError("no unused id")


def _as(uid: int, gid: int, groups: list[int], action) -> int:
    """Run `action` in a child that is user `uid` (group `gid`, supplementary `groups`)."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            code = action()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _health(endpoint: str, curve: dict[int, bytes] | None = None) -> int:
    """0 when a raw DEALER gets a ready health_reply within 15 s."""
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        for option, value in (curve or {}).items():
            dealer.setsockopt(option, value)
        dealer.connect(endpoint)
        dealer.send(codec.encode({"v": 1, "type": "health", "id": "h"}))
        if not dealer.poll(15_000):
            return 3
        reply = codec.decode(dealer.recv())
        return 0 if reply["type"] == "health_reply" and reply["ok"] else 4
    finally:
        context.destroy(linger=0)


def _refused(path: Path) -> int:
    """0 when connecting to the Unix socket is refused for lack of permission."""
    with socket.socket(socket.AF_UNIX) as unix:
        try:
            unix.connect(str(path))
        except PermissionError:
            return 0
    return 5


def test_group_members_reach_the_socket_under_umask_0027_and_tcp_allow_any_is_explicit(tmp_path):
    gid = _unused_id(grp.getgrgid)
    member, outsider = _unused_id(pwd.getpwuid), _unused_id(pwd.getpwuid) + 1
    keys = tmp_path / "keys"
    keys.mkdir()
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    _, client_secret = zmq.auth.create_certificates(keys, "anyone")  # on no allow-list
    port = free_port()
    # The daemon as the service unit runs it: its own group, UMask=0027.
    with run_daemon("--tcp-endpoint", f"tcp://127.0.0.1:{port}", "--curve-secret-key-file", str(server_secret),
                    "--curve-allow-any", group=gid, umask=0o027) as daemon:
        os.chmod(daemon.runtime_dir.parent, 0o711)  # the test's temporary directory, not the daemon's
        sock = daemon.runtime_dir / "hybridd.sock"
        for path in (sock, daemon.runtime_dir / "hybridd.sock.supervisor"):  # and the fallback endpoint
            assert path.stat().st_gid == gid and path.stat().st_mode & 0o777 == 0o660, path
        assert daemon.runtime_dir.stat().st_mode & 0o777 == 0o750
        assert _as(member, 100, [gid], lambda: _health(daemon.endpoint)) == 0
        assert _as(outsider, 100, [], lambda: _refused(sock)) == 0
        # curve_allow_any = true: a CURVE client whose key nobody listed is served.
        server_public, _ = zmq.auth.load_certificate(server_secret)
        public, secret = zmq.auth.load_certificate(client_secret)
        assert _health(f"tcp://127.0.0.1:{port}", {zmq.CURVE_SERVERKEY: server_public,
                                                   zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}) == 0
