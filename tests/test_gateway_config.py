"""The gateway's settings: endpoint parsing, the refusals of `hybridd start` before
anything is spawned, and the supervisor's restart budget for a gateway that keeps
exiting (real gateway processes that cannot bind their port)."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import time
from multiprocessing.connection import wait

import pytest

from hybridd.config import ConfigError, load_config, parse_host_port
from hybridd.gateway.supervised import SupervisedGateway
from tests.daemon import HYBRIDD


@pytest.mark.parametrize("value, expected", [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)),
    (":8000", ("127.0.0.1", 8000)),  # loopback unless a host is given
    ("0.0.0.0:80", ("0.0.0.0", 80)),
    ("[::1]:9000", ("::1", 9000)),
    ("localhost:65535", ("localhost", 65535)),
])
def test_host_port(value, expected):
    assert parse_host_port(value, "http_endpoint") == expected


@pytest.mark.parametrize("value", ["8000", "host:", "host:0", "host:70000", "host:http", "a b:80", "http://h:80"])
def test_bad_host_port_names_the_setting(value):
    with pytest.raises(ConfigError, match="http_endpoint"):
        load_config(overrides={"http_endpoint": value}, environ={})


def test_settings_that_contradict_each_other():
    with pytest.raises(ConfigError, match="metrics_endpoint must differ"):
        load_config(overrides={"http_endpoint": ":8000", "metrics_endpoint": "127.0.0.1:8000"}, environ={})
    with pytest.raises(ConfigError, match="http_api_key_file is set but http_endpoint is not"):
        load_config(overrides={"http_api_key_file": "/etc/keys"}, environ={})
    config = load_config(overrides={"metrics_endpoint": ":9400"}, environ={})
    assert config.serves_http and not config.http_endpoint
    assert not load_config(environ={}).serves_http  # off by default


@pytest.mark.parametrize("contents, expected", [
    (None, "cannot read"),
    ("# only a comment\n\n", "no API key in it"),
])
def test_start_refuses_an_unusable_api_key_file(tmp_path, contents, expected):
    key_file = tmp_path / "keys"
    if contents is not None:
        key_file.write_text(contents)
    result = subprocess.run(
        [HYBRIDD, "start", "--runtime-dir", str(tmp_path / "run"), "--http-endpoint", "127.0.0.1:1",
         "--http-api-key-file", str(key_file)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert f"http_api_key_file {key_file}" in result.stderr and expected in result.stderr
    assert not (tmp_path / "run" / "hybridd.pid").exists()


def _gateway_on(port: int) -> multiprocessing.Process:
    from hybridd.supervisor import SPAWN, worker_main

    config = load_config(overrides={"http_endpoint": f"127.0.0.1:{port}", "log_level": "critical"}, environ={})
    process = SPAWN.Process(target=worker_main, args=("gateway", "hybridd.gateway.process:main", config.to_dict(),
                                                       "", multiprocessing.current_process().pid or 0))
    process.start()
    return process


def test_a_gateway_that_keeps_exiting_is_restarted_with_backoff_then_given_up():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    spawned: list[int] = []

    def spawn():
        process = _gateway_on(port)
        spawned.append(process.pid)
        return process

    gateway = SupervisedGateway(spawn, max_restarts=2, restart_backoff_s=0.05)
    gateway.start()
    deadline = time.monotonic() + 120
    while not gateway.given_up and time.monotonic() < deadline:
        if gateway.sentinel is not None:
            wait([gateway.sentinel], timeout=1.0)
            if gateway.process is not None and gateway.process.exitcode is not None:
                gateway.exited()
        gateway.tick()
        time.sleep(0.01)
    taken.close()
    assert gateway.given_up, "the gateway was never given up on"
    assert len(spawned) == 3 and gateway.restarts == 2  # the first start and two restarts
    assert gateway.process is None
