"""Compiling the Triton kernels of a step ahead of its first run, in parallel processes.

Triton compiles a kernel at its first launch, one after another on the launching
thread, and the compiler holds the GIL (threads do not overlap it). A start with empty
caches compiled the 7B decode and prefill steps' kernels that way for most of half a
minute. Here the steps run once dry first: every Triton launch is recorded instead of
compiled and launched (Triton's `jit_cache_hook`), torch's own kernels run on whatever
the buffers hold. The recorded kernels are then compiled by a pool of spawned
processes, each writing Triton's on-disk cache, and the real warm-ups after it load
them from there.

A kernel a worker could not compile, or compiled under another cache key, is compiled
by the first launch as before: the pool only fills the cache, it never decides what
runs. Workers are given the kernel's module, name and Triton's own serialized
specialization (JSON), never a pickled object, and they need no GPU: they compile for
the target the parent names.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from hybridd.child_process import die_with_parent, set_process_title
from hybridd.log import get_logger
from hybridd.kernels import launch_variants

log = get_logger("kernel_precompile")


@dataclass(frozen=True)
class KernelSpec:
    """One specialization of one Triton kernel, as a worker process can rebuild it."""

    module: str
    name: str
    specialization: str  # JITFunction's serialized specialization data (JSON)

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class PrecompileReport:
    kernels: int = 0  # distinct specializations the dry runs launched
    missing: int = 0  # of those, not in Triton's cache: compiled by the workers
    workers: int = 0
    seconds: float = 0.0  # the dry runs and the compiling (`precompile`)
    failed: dict[str, str] = field(default_factory=dict)  # kernel label: error

    def as_dict(self) -> dict:
        return {"kernels": self.kernels, "missing": self.missing, "workers": self.workers,
                "seconds": round(self.seconds, 3), "failed": dict(self.failed)}


@contextlib.contextmanager
def _launches_recorded(specs: dict[str, KernelSpec]):
    """Meanwhile every Triton launch that would compile is recorded in `specs` and skipped
    (the launch does not run), and the kernel modules' record of which geometries had
    their variants launched is left as it was (`launch_variants.forgotten`)."""
    from triton import knobs

    def record(*, fn, compile, **_):
        jit = fn.jit_function
        spec = KernelSpec(jit.fn.__module__, jit.fn.__qualname__, compile["specialization_data"])
        specs.setdefault(spec.specialization, spec)
        return True  # skip compiling and launching

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        with launch_variants.forgotten():
            yield
    finally:
        knobs.runtime.jit_cache_hook = before


def record_launches(dry_runs: Callable[[], None]) -> list[KernelSpec]:
    """The Triton kernels `dry_runs()` would compile, in launch order; none of them runs."""
    specs: dict[str, KernelSpec] = {}
    with _launches_recorded(specs):
        dry_runs()
    return list(specs.values())


def current_target() -> tuple[str, int | str, int]:
    """The parent's Triton target (backend, arch, warp size), which the workers compile for."""
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return target.backend, target.arch, target.warp_size


class CompilePool:
    """Processes that compile kernels, started ahead of the specs they will get: each
    imports torch, Triton and the kernel modules as it starts (seconds), which the graph
    generator overlaps with its weights' load. `close` ends them."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self._executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=start_worker, initargs=(os.getpid(),))
        # A spawn pool starts a process per task that finds none idle: one task each starts
        # them all now. Each imports in its initializer, whichever of these tasks it draws.
        self._started = [self._executor.submit(os.getpid) for _ in range(workers)]

    def compile(self, specs: list[KernelSpec], target: tuple) -> PrecompileReport:
        """Compile those of `specs` that Triton's cache lacks, for `target`."""
        from triton import knobs

        missing = [spec for spec in specs if not _in_cache(spec, target)]
        report = PrecompileReport(kernels=len(specs), missing=len(missing),
                                  workers=min(self.workers, len(missing)))
        cache_dir = knobs.cache.dir
        futures = [self._executor.submit(compile_one, spec.module, spec.name, spec.specialization, target, cache_dir)
                   for spec in missing]
        for spec, future in zip(missing, futures):
            try:
                future.result()
            except Exception as exc:  # the first launch compiles it instead
                report.failed[spec.label] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return report

    def close(self) -> None:
        """End the processes (at once if idle); closing again does nothing."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def start_worker(parent_pid: int) -> None:
    """A worker's first code: it dies with the process that started it (a graph generator
    killed mid-start must not leave its compilers behind), names itself and imports what
    every compile needs, while nothing waits for it yet."""
    if not die_with_parent(parent_pid):
        os._exit(1)
    set_process_title("hybridd: kernel compiler")
    import_kernel_modules()


# The modules whose kernels the graphs launch, imported by each worker as it starts.
KERNEL_MODULES = ("hybridd.kernels.triton_gemm", "hybridd.kernels.triton_attention", "hybridd.kernels.triton_ops",
                  "hybridd.kernels.triton_fp8", "hybridd.kernels.triton_quantize")


def import_kernel_modules() -> None:
    """The imports every compile needs: torch, Triton and the kernel modules."""
    import triton.compiler  # noqa: F401

    for module in KERNEL_MODULES:
        importlib.import_module(module)


def _rebuilt(module: str, name: str, specialization: str, target: tuple):
    """The kernel's source, target and options, rebuilt from its serialized specialization
    as `JITFunction.preload` rebuilds them, without a device."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    fn = getattr(importlib.import_module(module), name)
    data = json.loads(specialization)
    constexprs = {
        tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value)
        else tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
        for key, value in zip(data["constant_keys"], data["constant_vals"])
    }
    attrs = {tuple(key): value for key, value in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {key: convert_to_tuple_if_list(value) for key, value in data["signature"].items()}
    options = {key: tuple(value) if isinstance(value, list) else value for key, value in data["options"].items()}
    gpu = GPUTarget(*target)
    backend = make_backend(gpu)
    return ASTSource(fn, signature, constexprs, attrs), gpu, backend, backend.parse_options(options)


def _in_cache(spec: KernelSpec, target: tuple) -> bool:
    """Whether Triton's cache holds the kernel already (its metadata file, under the key
    `triton.compile` looks it up by); False when that cannot be told."""
    try:
        import hashlib

        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.runtime.cache import get_cache_key, get_cache_manager

        src, _, backend, options = _rebuilt(spec.module, spec.name, spec.specialization, target)
        key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
        manager = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
        return manager.get_group(f"{src.name[:150]}.json") is not None
    except Exception:  # an internal of another Triton version: compile it to be sure
        return False


def compile_one(module: str, name: str, specialization: str, target: tuple, cache_dir: str) -> None:
    """In a worker: compile one kernel specialization into Triton's cache at `cache_dir`."""
    import triton
    from triton import knobs

    knobs.cache.dir = cache_dir
    src, gpu, _, options = _rebuilt(module, name, specialization, target)
    triton.compile(src, target=gpu, options=options.__dict__)


def precompile(dry_runs: Callable[[], None], pool: CompilePool) -> PrecompileReport:
    """Record what `dry_runs()` would compile and compile it in `pool`."""
    started = time.perf_counter()
    specs = record_launches(dry_runs)
    report = pool.compile(specs, current_target())
    report.seconds = time.perf_counter() - started
    log.info("kernels_precompiled", **report.as_dict())
    if report.failed:
        log.warning("kernels_not_precompiled", failed=report.failed,
                    consequence="their first launches compile them")
    return report
