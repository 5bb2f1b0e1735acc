"""Where a daemon answers: its client endpoint, and the supervisor's fallback endpoint
beside it (protocol/SPEC.md §1), which answers from the supervisor's start to its exit
while the client endpoint may not exist (start-up, worker restarts)."""

from __future__ import annotations

FALLBACK_SUFFIX = ".supervisor"


def fallback_endpoint(client_endpoint: str) -> str | None:
    """`ipc://…/hybridd.sock` → `ipc://…/hybridd.sock.supervisor`; None for TCP and
    abstract sockets (the fallback is a file beside the client socket)."""
    if not client_endpoint.startswith("ipc://") or client_endpoint.startswith("ipc://@"):
        return None
    return client_endpoint + FALLBACK_SUFFIX
