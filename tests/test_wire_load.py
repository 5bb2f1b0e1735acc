"""The load script (scripts/load_wire.py) bounded for CI, against the real daemon: 6 raw
clients (well-behaved greedy streams, some cancelling; one that disconnects mid-stream
and reconnects; one slow reader), 96 requests. Nothing may be lost, hang or differ
from the same greedy request run alone; nothing may be left running; the KV blocks come
back and no worker restarts. The full run, with a client sending maximal prompts too, is
`python -m scripts.load_wire --start --requests 2048 --clients 32`."""

from __future__ import annotations

from tests.daemon import run_daemon
from tests.wire_scripts import run_tool


def test_misbehaving_clients_cost_the_others_nothing():
    with run_daemon() as daemon:
        code, report = run_tool("load_wire", "--endpoint", daemon.endpoint, "--requests", "96", "--clients", "6",
                                "--seed", "5", "--paused-s", "3", "--no-maximal")
    assert report["lost"] == report["hung"] == report["mismatched"] == report["engine_dead"] == 0, report
    assert report["orphans_after"] == 0 and report["workers_unchanged"], report
    assert report["kv_blocks_used"]["after"] == report["kv_blocks_used"]["before"], report
    assert report["completed"] > 50 and report["disconnected_on_purpose"] > 0, report
    assert report["ok"] and code == 0, report
