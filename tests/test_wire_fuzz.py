"""The wire fuzzer (scripts/fuzz_wire.py) against the real daemon, bounded for CI: the
corpus of messages that once hurt the daemon, then 2,000 generated messages from a fixed
seed. Every reply must match protocol/SPEC.md, every request must get exactly its
replies, and the worker pids and restart counters must not change. The full run
(10,000+ messages) is `python -m scripts.fuzz_wire --start --count 10000`."""

from __future__ import annotations

import json

from tests.daemon import run_daemon
from tests.wire_scripts import run_tool


def test_fuzzed_messages_get_spec_replies_and_hurt_no_worker():
    with run_daemon() as daemon:
        code, report = run_tool("fuzz_wire", "--endpoint", daemon.endpoint, "--count", "2000", "--seed", "13")
    assert report["violations"] == 0 and code == 0, json.dumps(report["first_violations"], indent=1)
    assert report["messages"] == 2000 + report["corpus_messages"] and report["corpus_messages"] > 0
    # The generated mix reaches every kind of refusal, not only one.
    assert {"malformed", "invalid_request", "unsupported_version", "too_large"} <= set(report["error_codes"])
