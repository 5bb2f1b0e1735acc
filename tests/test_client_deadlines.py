"""The SDK never waits forever for a daemon that is not there: every call has a connect
deadline, and the error says what was found at the endpoint (no socket file, a socket
nobody listens on, a listener that never speaks ZeroMQ). The CURVE refusal and the
command-line exit codes are tested against the real daemon in test_cli_daemon."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from hybridd import (
    AsyncClient,
    Client,
    DaemonUnreachableError,
    RequestTimeoutError,
    UnavailableError,
)
from hybridd.client import CONNECT_TIMEOUT_S
from hybridd.errors import HandshakeRefusedError, InternalError, InvalidRequestError, error_for_code
from hybridd.protocol.errors import ErrorCode

# Fail-fast answers must come well inside this even on a saturated host.
PROMPT_ANSWER_S = 5.0


def stale_socket(path: Path) -> str:
    """A socket file with nobody behind it: what a daemon killed with SIGKILL leaves."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()
    return f"ipc://{path}"


def calls(client: Client):
    return {
        "generate": lambda **kw: client.generate("x", max_tokens=2, **kw),
        "stream": lambda **kw: list(client.stream("x", max_tokens=2, **kw)),
        "health": lambda **kw: client.health(**kw),
        "status": lambda **kw: client.status(**kw),
    }


def test_the_default_connect_timeout_is_finite_and_configurable():
    assert 0 < CONNECT_TIMEOUT_S <= 30
    with Client("ipc:///no/such/dir/hybridd.sock") as client:
        assert client.connect_timeout == CONNECT_TIMEOUT_S
    with Client("ipc:///no/such/dir/hybridd.sock", connect_timeout=0.25) as client:
        assert client.connect_timeout == 0.25
    with pytest.raises(ValueError, match="connect_timeout"):
        Client("ipc:///no/such/dir/hybridd.sock", connect_timeout=0)


@pytest.mark.parametrize("call", ["generate", "stream", "health", "status"])
def test_missing_socket_file_fails_at_once(call):
    with Client("ipc:///no/such/dir/hybridd.sock") as client:
        started = time.monotonic()
        with pytest.raises(DaemonUnreachableError) as caught:
            calls(client)[call]()
        assert time.monotonic() - started < PROMPT_ANSWER_S
    error = caught.value
    assert isinstance(error, UnavailableError) and isinstance(error, ConnectionError)
    assert error.code == ErrorCode.UNAVAILABLE
    assert str(error) == ("unavailable: no daemon at ipc:///no/such/dir/hybridd.sock "
                          "(no socket file /no/such/dir/hybridd.sock)")


@pytest.mark.parametrize("call", ["generate", "stream", "health", "status"])
def test_stale_socket_fails_after_the_connect_timeout(tmp_path, call):
    endpoint = stale_socket(tmp_path / "hybridd.sock")
    with Client(endpoint, connect_timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(DaemonUnreachableError, match=r"nothing listens on .*hybridd\.sock \(a stale socket"):
            calls(client)[call]()
        assert 0.3 <= time.monotonic() - started < PROMPT_ANSWER_S


def test_per_call_connect_timeout_overrides_the_clients(tmp_path):
    endpoint = stale_socket(tmp_path / "hybridd.sock")
    with Client(endpoint, connect_timeout=60) as client:
        started = time.monotonic()
        with pytest.raises(DaemonUnreachableError, match="within 0.2 s"):
            client.generate("x", connect_timeout=0.2)
        with pytest.raises(DaemonUnreachableError, match="within 0.2 s"):
            client.health(connect_timeout=0.2)
        # A call timeout shorter than the connect timeout bounds the wait too.
        with pytest.raises(DaemonUnreachableError, match="within 0.2 s"):
            client.status(timeout=0.2)
        assert time.monotonic() - started < PROMPT_ANSWER_S


def test_listener_that_never_speaks_zeromq_is_no_daemon(tmp_path):
    path = tmp_path / "silent.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(8)  # accepts connections in the kernel, never answers the ZMTP greeting
    try:
        with Client(f"ipc://{path}", connect_timeout=0.3) as client:
            with pytest.raises(DaemonUnreachableError, match=r"no answer from ipc://.*silent\.sock within 0\.3 s"):
                client.generate("x")
    finally:
        listener.close()


def test_nothing_listening_on_a_tcp_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import zmq

    public, secret = zmq.curve_keypair()
    with Client(f"tcp://127.0.0.1:{port}", server_public_key=public, public_key=public, secret_key=secret,
                connect_timeout=0.3) as client:
        with pytest.raises(DaemonUnreachableError, match=f"nothing accepts connections at tcp://127.0.0.1:{port}"):
            client.health()


def test_async_client_has_the_same_deadlines(tmp_path):
    endpoint = stale_socket(tmp_path / "hybridd.sock")

    async def main() -> None:
        async with AsyncClient("ipc:///no/such/dir/hybridd.sock") as missing:
            with pytest.raises(DaemonUnreachableError, match="no socket file"):
                await missing.generate("x")
            with pytest.raises(DaemonUnreachableError, match="no socket file"):
                async for _ in missing.stream("x"):
                    pass
        async with AsyncClient(endpoint, connect_timeout=0.3) as stale:
            for call in (stale.generate("x"), stale.health(), stale.status()):
                with pytest.raises(DaemonUnreachableError, match="nothing listens"):
                    await call
            with pytest.raises(DaemonUnreachableError, match="within 0.1 s"):
                async for _ in stale.stream("x", connect_timeout=0.1):
                    pass

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 4 * PROMPT_ANSWER_S


def test_a_daemon_that_starts_later_is_reached_by_the_same_client(tmp_path):
    """A connect deadline is per call: the client keeps reconnecting in between."""
    import zmq

    path = tmp_path / "hybridd.sock"
    with Client(f"ipc://{path}", connect_timeout=0.2) as client:
        with pytest.raises(DaemonUnreachableError):
            client.health()
        context = zmq.Context()
        router = context.socket(zmq.ROUTER)
        router.bind(f"ipc://{path}")
        try:
            with pytest.raises(RequestTimeoutError):  # reached, but this stand-in never answers
                client.health(connect_timeout=PROMPT_ANSWER_S, timeout=0.5)
            assert client.connected
        finally:
            router.close(0)
            context.term()


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_error_code_reads_as_its_exception(code):
    error = error_for_code(code.value, "why")
    assert error.code is code and type(error).default_code in (code, ErrorCode.INVALID_REQUEST)
    assert isinstance(error, InvalidRequestError) == (code in (ErrorCode.MALFORMED, ErrorCode.TOO_LARGE,
                                                              ErrorCode.UNSUPPORTED_VERSION, ErrorCode.INVALID_REQUEST))
    assert str(error) == f"{code.value}: why"


def test_an_unknown_error_code_reads_as_internal():
    error = error_for_code("from_the_future", "why")
    assert type(error) is InternalError and error.code is ErrorCode.INTERNAL and error.message == "[from_the_future] why"


def test_unavailable_code_maps_to_its_exception():
    error = error_for_code("unavailable", "the daemon is loading (weights 3/7)")
    assert type(error) is UnavailableError and error.code == ErrorCode.UNAVAILABLE
    assert issubclass(DaemonUnreachableError, UnavailableError)
    assert issubclass(HandshakeRefusedError, DaemonUnreachableError)
    assert issubclass(HandshakeRefusedError, ConnectionRefusedError)
