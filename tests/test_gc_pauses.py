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


def test_a_capture_before_start_up_ends_unfrozen_and_restores_the_collector():
    out = run("""
        import gc
        from hybridd.runtime import gc_pauses
        with gc_pauses.no_collection():
            during = (gc.isenabled(), gc.get_freeze_count() > 0)
        enabled = gc.isenabled()
        gc.disable()
        with gc_pauses.no_collection():
            pass
        print(during, enabled, gc.get_freeze_count(), gc.isenabled())
    """)
    assert out == "(False, True) True 0 False"
