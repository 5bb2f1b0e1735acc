"""The exit codes of `hybridd` commands, `hybridd start` (the supervisor) above all.

Each failure that a service manager or an operator must tell apart has its own code;
the systemd unit does not restart on the codes that no restart can fix
(`RestartPreventExitStatus=` in systemd/hybridd.service).
"""

OK = 0
ERROR = 1  # a command failed; for `start`: the drain had to be forced, or an unexpected error
USAGE = 2  # invalid configuration, model directory or key file (checked before anything is spawned)
ALREADY_RUNNING = 3  # another supervisor holds the runtime directory or serves the endpoint
STARTUP_FAILED = 4  # a worker found an error that no restart can fix (unreadable weights, out of memory)
RESTARTS_EXHAUSTED = 5  # the workers kept failing: max_restarts restarts within the stable period
# Client commands (generate, status, stop) that could not reach a serving daemon:
NOT_RUNNING = 6  # no daemon at the endpoint: no socket file, nothing listening, no handshake in time
REFUSED = 7  # the daemon refused this client's CURVE keys
UNAVAILABLE = 8  # the daemon runs but does not serve now: starting, restarting workers, draining, no reply
INTERRUPTED = 130  # a client command stopped by Ctrl-C

# Never worth a restart by the service manager: the same start would fail the same way.
PERMANENT = (USAGE, STARTUP_FAILED)
