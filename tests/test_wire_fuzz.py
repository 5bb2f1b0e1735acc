"""The wire fuzzer (scripts/fuzz_wire.py) against the real daemon, bounded for CI: the
corpus of messages that once hurt the daemon, then 2,000 generated messages from a fixed
seed. Every reply must match protocol/SPEC.md, every request must get exactly its
replies, and the worker pids and restart counters must not change. The full run
(10,000+ messages) is `python scripts/fuzz_wire.py --start --count 10000`."""

from __future__ import annotations

import pytest

from tests.daemon import run_daemon
from tests.wire_scripts import load_script


@pytest.fixture(scope="module")
def fuzzed():
    fuzz_wire = load_script("fuzz_wire")
    with run_daemon() as daemon:
        report = fuzz_wire.fuzz(daemon.endpoint, count=2000, seed=13)
    return fuzz_wire, report


def test_fuzzed_messages_get_spec_replies_and_hurt_no_worker(fuzzed):
    fuzz_wire, report = fuzzed
    assert report.sent == 2000 + len(fuzz_wire.corpus())
    assert not report.violations, "\n".join(report.violations[:30])
    # The generated mix reaches every kind of refusal, not only one.
    assert {"malformed", "invalid_request", "unsupported_version", "too_large"} <= set(report.codes)
