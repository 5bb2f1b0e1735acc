"""The wire fuzzer (scripts/fuzz_wire.py) against the real daemon, bounded for CI: the
corpus of messages that once hurt the daemon, then 1,000 generated messages from a fixed
seed (every version's fields broken, bit flips, truncations, ext types, depth bombs,
duplicate ids, cancels, chosen routing ids), a health sentinel after each, a canary
stream and a second session beside them. Every reply must match protocol/SPEC.md, every
request must get exactly its replies, the daemon must be ready after every message, and
the worker pids and restart counters must not change. The full run (20,000+ messages)
is `python -m scripts.fuzz_wire --start --count 20000`."""

from __future__ import annotations

import json

from tests.daemon import run_daemon
from tests.wire_scripts import run_tool


def test_fuzzed_messages_get_spec_replies_and_hurt_no_worker():
    with run_daemon() as daemon:
        code, report = run_tool("fuzz_wire", "--endpoint", daemon.endpoint, "--count", "1000", "--seed", "13")
    assert report["violations"] == 0 and code == 0, json.dumps(report["first_violations"], indent=1)
    assert report["messages"] == 1000 + report["corpus_messages"] and report["corpus_messages"] > 0
    assert report["sentinels"] == report["messages"] and report["worker_changes"] == []
    assert report["canaries"] >= 2 and report["second_session_rounds"] >= 1
    # The generated mix reaches every kind of refusal, not only one.
    assert {"malformed", "invalid_request", "unsupported_version", "too_large"} <= set(report["error_codes"])
