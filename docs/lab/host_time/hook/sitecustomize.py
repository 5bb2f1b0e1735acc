"""cProfile by signal, for the lab's host-time measurement (docs/lab/host_time/measure.py).

On PYTHONPATH ahead of a tree, with LAB_HOST_PROFILE=PREFIX in the environment, every
Python process started there (the workers included) profiles its main thread between a
SIGUSR1 (start) and a SIGUSR2 (stop: writes PREFIX-<pid>-<n>.prof), timing by the
thread's CPU clock, so that a function's time is the CPU it cost, not the time it waited.
Nothing happens without the variable. Lab, not product.
"""

import os

if os.environ.get("LAB_HOST_PROFILE"):
    import cProfile
    import signal
    import time

    _state = {"profile": None, "n": 0}

    def _start(signum, frame):
        _state["profile"] = cProfile.Profile(time.thread_time)
        _state["profile"].enable()

    def _stop(signum, frame):
        profile = _state["profile"]
        if profile is None:
            return
        profile.disable()
        _state["n"] += 1
        profile.dump_stats(f"{os.environ['LAB_HOST_PROFILE']}-{os.getpid()}-{_state['n']}.prof")
        _state["profile"] = None

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
