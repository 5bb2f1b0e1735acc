"""The systemd notification protocol (sd_notify(3)), implemented without a dependency.

`Notifier` sends `KEY=VALUE` lines as one datagram to the unix socket named by
`$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Without
`$NOTIFY_SOCKET` (not run by systemd, or `Type=` is not `notify`) every call is a
no-op, so the supervisor never has to ask. `watchdog_interval_s` reads systemd's
`$WATCHDOG_USEC`/`$WATCHDOG_PID`.
"""

from __future__ import annotations

import os
import socket

from hybridd import environment
from hybridd.log import get_logger

log = get_logger("sd_notify")

# systemd reads at most this much of a STATUS= line; longer text is cut here, not there.
MAX_STATUS_CHARS = 1024


def _address(value: str) -> str | bytes:
    # "@name" is Linux's abstract namespace: a leading NUL byte instead of a file.
    return b"\0" + value[1:].encode() if value.startswith("@") else value


class Notifier:
    """Sends notifications to systemd; a no-op without `$NOTIFY_SOCKET`."""

    def __init__(self, notify_socket: str | None = None) -> None:
        target = (environment.get("NOTIFY_SOCKET") or "") if notify_socket is None else notify_socket
        self._address: str | bytes | None = _address(target) if target else None
        self._socket: socket.socket | None = None
        if self._address is not None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, **fields: str | int) -> bool:
        """Send `KEY=VALUE` lines in one datagram, e.g. `notify(READY=1, STATUS="ready")`.

        Returns False when disabled or when systemd is not listening; never raises,
        because the daemon must keep serving when its notification socket goes away.
        """
        if self._socket is None:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value).replace("\n", " ")
            if key == "STATUS":
                text = text[:MAX_STATUS_CHARS]
            lines.append(f"{key}={text}")
        try:
            self._socket.sendto("\n".join(lines).encode(), self._address)
        except OSError as error:
            if not self._failed:
                log.warning("cannot notify systemd", socket=environment.get("NOTIFY_SOCKET"), error=str(error))
            self._failed = True
            return False
        self._failed = False
        return True

    def ready(self, status: str) -> bool:
        return self.notify(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.notify(STATUS=status)

    def stopping(self, status: str) -> bool:
        return self.notify(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def watchdog_interval_s() -> float | None:
    """How often to send `WATCHDOG=1` (half of `WatchdogSec=`), or None when not enabled for us."""
    usec = environment.get("WATCHDOG_USEC") or ""
    pid = environment.get("WATCHDOG_PID") or ""
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2e6
