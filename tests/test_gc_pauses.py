"""The cyclic collector around the serving loops (hybridd/runtime/gc_pauses.py), in a
fresh interpreter each, since freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_start_up_objects_leave_the_collectors_reach():
    out = run("""
        import gc
        import torch  # what a worker holds after start-up, in kind
        from hybridd.runtime import gc_pauses
        frozen = gc_pauses.freeze_start_up()
        print(frozen > 10000, gc.get_freeze_count() == frozen, gc.isenabled(), len(gc.get_objects()) < 1000)
    """)
    assert out == "True True True True"


def test_a_capture_keeps_the_start_up_freeze():
    out = run("""
        import gc
        from hybridd.runtime import gc_pauses
        frozen = gc_pauses.freeze_start_up()
        with gc_pauses.no_collection():
            during = (gc.isenabled(), gc.get_freeze_count() >= frozen)
        print(during, gc.isenabled(), gc.get_freeze_count() >= frozen)
    """)
    assert out == "(False, True) True True"


def test_a_capture_before_start_up_freezes_nothing_and_restores_the_collector():
    out = run("""
        import gc
        from hybridd.runtime import gc_pauses
        with gc_pauses.no_collection():
            during = (gc.isenabled(), gc.get_freeze_count())
        enabled = gc.isenabled()
        gc.disable()
        with gc_pauses.no_collection():
            pass
        print(during, enabled, gc.get_freeze_count(), gc.isenabled())
    """)
    assert out == "(False, 0) True 0 False"


def test_entering_a_capture_does_not_walk_the_frozen_objects():
    """Entering holds the GIL: its cost must not grow with the frozen objects, as a count
    of them (`gc.get_freeze_count()`, a walk of the list) does. Both take the best of
    five, so a busy host does not decide it."""
    out = run("""
        import gc, time
        from hybridd.runtime import gc_pauses
        keep = [[i] for i in range(1_500_000)]  # a worker's start-up objects, several times over
        gc_pauses.freeze_start_up()

        def best(fn):
            times = []
            for _ in range(5):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times)

        def enter_and_leave():
            with gc_pauses.no_collection():
                pass

        walk, enter = best(gc.get_freeze_count), best(enter_and_leave)
        print(enter * 20 < walk, f"{enter * 1e3:.3f} ms to enter and leave, {walk * 1e3:.3f} ms to count")
    """)
    assert out.startswith("True"), out
