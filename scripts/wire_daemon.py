"""The daemon a wire script (fuzz_wire.py, load_wire.py) runs against: `--endpoint`
names a running one; `--start`, or no endpoint, starts one on the embedded model for
the run and drains it at the end (the tests' `tests.daemon.run_daemon`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def argument_parser(description: str | None) -> argparse.ArgumentParser:
    """A script's parser, with the daemon's arguments (`--endpoint`, `--start`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", help="a running daemon (default: --start one)")
    parser.add_argument("--start", action="store_true", help="start a daemon on the embedded model for the run")
    return parser


@contextlib.contextmanager
def daemon_endpoint(args: argparse.Namespace) -> Iterator[str]:
    """The endpoint to run against, with the daemon started for the run when asked."""
    if args.endpoint and not args.start:
        yield args.endpoint
        return
    sys.path.insert(0, str(REPO))
    from tests.daemon import run_daemon

    with run_daemon() as daemon:
        yield daemon.endpoint
