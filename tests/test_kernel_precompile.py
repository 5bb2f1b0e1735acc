"""The kernel precompile's worker pool, on any host: real spawned processes compile one of
hybridd's Triton kernels for a Hopper target (no GPU needed) into Triton's on-disk
cache, report a kernel they cannot build by name, and start nothing for kernels the
cache already holds. The dry runs that record a step's launches need CUDA
(tests/test_gpu_graph_runner.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("triton")

from hybridd.kernels import launch_variants  # noqa: E402
from hybridd.runtime import kernel_precompile  # noqa: E402
from hybridd.runtime.kernel_precompile import KernelSpec  # noqa: E402
from tests.host_load import on_this_host, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

TARGET = ("cuda", 90, 32)


def _rms_norm_spec(block: int, name: str = "_rms_norm_kernel") -> KernelSpec:
    """The specialization a bf16 launch of triton_ops' RMSNorm kernel records, serialized
    as Triton serializes it for its hooks."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    pointers = ["x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"]
    signature = {**{p: "*bf16" for p in pointers}, "n_cols": "i32", "eps": "fp32",
                 "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"}
    constants = {(7,): True, (8,): block, (9,): True}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    options = make_backend(GPUTarget(*TARGET)).parse_options({"num_warps": 4, "launch_pdl": True})
    data = serialize_specialization_data(f"hybridd.kernels.triton_ops.{name}", signature, constants, attrs, options,
                                         key="test")
    return KernelSpec("hybridd.kernels.triton_ops", name, data)


_COMPILE_TWICE = """
import json
from hybridd.runtime import kernel_precompile as kp
from tests.test_kernel_precompile import TARGET, _rms_norm_spec

good, other, missing = _rms_norm_spec(4096), _rms_norm_spec(2048), _rms_norm_spec(4096, name="_no_such_kernel")
before = kp._in_cache(good, TARGET)
with kp.CompilePool(2) as pool:
    first = pool.compile([good, other, missing], TARGET)
    after = [kp._in_cache(good, TARGET), kp._in_cache(other, TARGET)]
    again = pool.compile([good, other], TARGET)
pool.close()  # closed twice (again on leaving the block): nothing more happens
print(json.dumps({"before": before, "first": first.as_dict(), "after": after, "again": again.as_dict()}))
"""


@pytest.mark.slow
def test_workers_fill_the_cache_and_name_what_they_could_not_build(tmp_path):
    # In a process of its own without TRITON_INTERPRET (which the CPU test session sets):
    # its kernels are compiled ones there, as in the daemon.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE_TWICE], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=on_this_host(120))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])

    assert result["before"] is False
    first = result["first"]
    assert (first["kernels"], first["missing"], first["workers"]) == (3, 3, 2)
    assert list(first["failed"]) == ["hybridd.kernels.triton_ops._no_such_kernel"], first["failed"]
    assert "AttributeError" in first["failed"]["hybridd.kernels.triton_ops._no_such_kernel"]
    assert result["after"] == [True, True]
    cubins = sorted(p.name for p in (tmp_path / "cache").rglob("*.cubin"))
    assert cubins == ["_rms_norm_kernel.cubin"] * 2
    again = result["again"]
    assert (again["kernels"], again["missing"], again["workers"], again["failed"]) == (2, 0, 0, {})


_POOL_THEN_WAIT = """
import multiprocessing, time
from hybridd.runtime.kernel_precompile import CompilePool
pool = CompilePool(2)
for started in pool._started:
    started.result()
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
time.sleep(600)
"""


def _title(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return cmdline.read().split(b"\0")[0].strip()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_workers_die_with_the_process_that_started_them(tmp_path):
    """A graph generator killed mid-start (SIGKILL: no clean-up of its own runs) leaves no
    compiler processes behind; in ps they are named for what they are."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # Its stderr to a file: multiprocessing's resource tracker warns there of the owner's
    # semaphores when it outlives the owner.
    errors = tmp_path / "owner.err"
    with errors.open("w") as stderr:
        owner = subprocess.Popen([sys.executable, "-c", _POOL_THEN_WAIT], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        workers = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(workers) == 2 and all(_running(pid) for pid in workers), (workers, errors.read_text())
        # A worker that drew no task of its own may still be in its initializer: awaited.
        wait_for(lambda: [_title(pid) for pid in workers] == [b"hybridd: kernel compiler"] * 2, 30,
                 what="the workers are not named 'hybridd: kernel compiler' in ps")
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + on_this_host(10)
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _running(pid)]


def test_a_spec_the_cache_cannot_be_asked_about_counts_as_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    broken = KernelSpec("hybridd.kernels.triton_ops", "_rms_norm_kernel", "{not json")
    assert not kernel_precompile._in_cache(broken, TARGET)
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        kernel_precompile.CompilePool(0)


def test_a_dry_run_leaves_the_variant_record_as_it_was():
    import torch

    cpu = torch.device("cpu")
    assert launch_variants.first_eager_call(("test", "before"), cpu)
    with launch_variants.forgotten():
        assert launch_variants.first_eager_call(("test", "dry"), cpu)
        assert not launch_variants.first_eager_call(("test", "before"), cpu)
    assert launch_variants.first_eager_call(("test", "dry"), cpu)  # launched for real now
    assert not launch_variants.first_eager_call(("test", "before"), cpu)
