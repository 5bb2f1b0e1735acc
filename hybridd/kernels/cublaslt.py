"""cuBLASLt products with an algorithm of our choosing, called through ctypes.

PyTorch runs a projection on cuBLAS with the first algorithm the library's heuristic
names for its shape. For the prefill's 64-256 rows that first choice reads the weight
at 58-90 % of the copy bandwidth. cuBLASLt's heuristic can name more candidates (other
tiles, stages, splits of K and their reduction schemes) for the same product, and each
of its algorithms takes configurations the heuristic never names (every tile, cluster
shape, custom option and swizzle the algorithm lists as a capability, each checked by
the library); an `LtProduct` lists both, builds an algorithm from a configuration read
back earlier, and runs y = x @ W.T (or adds it to y in place, beta = 1) with the one it
is given, on PyTorch's current stream, so that it can be captured in a CUDA graph like
any other kernel. Which candidate to give is measured (`scripts/bench_cublaslt.py`).

The library is the one PyTorch loaded (found among the process's mapped files), so the
two share a version. Only CUDA builds have it: nothing here runs on the CPU.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType_t
_DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D
# cublasLtMatmulAlgoCapAttributes_t: what an algorithm can be configured with.
_CAP_SPLIT_K, _CAP_REDUCTION_MASK, _CAP_SWIZZLING, _CAP_TILE_IDS, _CAP_CUSTOM_MAX, _CAP_STAGES_IDS = 0, 1, 2, 6, 7, 13
# cublasLtClusterShape_t: 0 is automatic, 2 up are shapes (1x1x1, 2x1x1, ...); no capability
# lists them, so an enumeration tries each below this bound and keeps those the check takes.
CLUSTER_SHAPE_BOUND = 48
# cublasLtMatmulAlgoConfigAttributes_t, all of them a candidate carries.
CONFIG_ATTRIBUTES = {
    "algo_id": (0, ctypes.c_int32), "tile": (1, ctypes.c_uint32), "split_k": (2, ctypes.c_uint32),
    "reduction": (3, ctypes.c_uint32), "swizzle": (4, ctypes.c_uint32), "custom": (5, ctypes.c_uint32),
    "stages": (6, ctypes.c_uint32), "inner_shape": (7, ctypes.c_uint16), "cluster_shape": (8, ctypes.c_uint16),
}


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than success."""


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library_path() -> str:
    """The libcublasLt PyTorch has mapped into this process."""
    torch.cuda.init()
    ones = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
    torch.nn.functional.linear(ones, ones, ones[0])  # a product with a bias: PyTorch runs it on cuBLASLt
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcublasLt.so" in path:
                return path
    raise CublasLtError("PyTorch has not loaded libcublasLt in this process")


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    p, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i32, i32],
        "cublasLtMatmulDescSetAttribute": [p, i32, p, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i32, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, i32, p, sz],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i32, ctypes.POINTER(_HeuristicResult),
                                           ctypes.POINTER(i32)],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, ctypes.POINTER(_Algo), ctypes.POINTER(_HeuristicResult)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i32, p, sz, ctypes.POINTER(sz)],
        "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(_Algo), i32, p, sz],
        "cublasLtMatmulAlgoGetIds": [p, i32, i32, i32, i32, i32, i32, i32, ctypes.POINTER(i32), ctypes.POINTER(i32)],
        "cublasLtMatmulAlgoInit": [p, i32, i32, i32, i32, i32, i32, i32, ctypes.POINTER(_Algo)],
        "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(_Algo), i32, p, sz, ctypes.POINTER(sz)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, sz, p],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CublasLtError(f"{call} returned cuBLAS status {status}")


@functools.cache
def _handle() -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@dataclass
class Candidate:
    """One algorithm for a product: cuBLASLt's opaque struct, the workspace it needs,
    and its configuration read back (the heuristic's choice of tile, split, stages)."""

    algo: _Algo
    workspace_bytes: int
    config: dict[str, int]

    def describe(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.config.items())


class LtProduct:
    """y [m, n] = x [m, k] @ W.T for W [n, k] as `nn.Linear` stores it (row-major; in
    cuBLAS's column-major terms D [n, m] = op(A) B with A = W transposed), or y += x @ W.T
    where `accumulate` (beta = 1, C = D = y). Contiguous tensors of one dtype."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype, accumulate: bool = False) -> None:
        if dtype not in _DATA_TYPES:
            raise ValueError(f"cuBLASLt products take {', '.join(map(str, _DATA_TYPES))}, got {dtype}")
        self.shape = (m, n, k)
        self.dtype = dtype
        self.accumulate = accumulate
        lib, data_type = _lib(), _DATA_TYPES[dtype]
        self._types = (_COMPUTE_32F, _R_32F, data_type, data_type, data_type, data_type)
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _R_32F),
               "cublasLtMatmulDescCreate")
        for attribute, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, attribute, ctypes.byref(value), 4),
                   "cublasLtMatmulDescSetAttribute")
        self._a, self._b, self._c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, (rows, cols) in ((self._a, (k, n)), (self._b, (k, m)), (self._c, (n, m))):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), data_type, rows, cols, rows),
                   "cublasLtMatrixLayoutCreate")
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(1.0 if accumulate else 0.0)

    def candidates(self, workspace_bytes: int, count: int = 32, alignment: int = 256) -> list[Candidate]:
        """The heuristic's algorithms for this product, best-guess first, each needing at
        most `workspace_bytes` and working with operands aligned to `alignment` bytes."""
        lib = _lib()
        preference = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(workspace_bytes)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(preference, _PREF_MAX_WORKSPACE_BYTES,
                                                        ctypes.byref(limit), 8),
               "cublasLtMatmulPreferenceSetAttribute")
        for attribute in _PREF_MIN_ALIGNMENT:
            value = ctypes.c_uint32(alignment)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(preference, attribute, ctypes.byref(value), 4),
                   "cublasLtMatmulPreferenceSetAttribute")
        results = (_HeuristicResult * count)()
        returned = ctypes.c_int32(0)
        try:
            _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(), self._desc, self._a, self._b, self._c, self._c,
                                                      preference, count, results, ctypes.byref(returned)),
                   "cublasLtMatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(preference)
        return [Candidate(result.algo, int(result.workspace_size), read_config(result.algo))
                for result in results[:returned.value] if result.state == 0]

    def variant(self, candidate: Candidate, **config: int) -> Candidate | None:
        """`candidate` with some of its configuration changed (e.g. split_k, reduction),
        or None where cuBLASLt refuses that configuration for this product."""
        return self._checked(_copy(candidate.algo), config)

    def algo_ids(self, limit: int = 256) -> list[int]:
        """The ids of the algorithms the library has for this product's types."""
        ids, returned = (ctypes.c_int32 * limit)(), ctypes.c_int32(0)
        _check(_lib().cublasLtMatmulAlgoGetIds(_handle(), *self._types, limit, ids, ctypes.byref(returned)),
               "cublasLtMatmulAlgoGetIds")
        return list(ids[:returned.value])

    def _initialized(self, algo_id: int) -> _Algo | None:
        algo = _Algo()
        if _lib().cublasLtMatmulAlgoInit(_handle(), *self._types, algo_id, ctypes.byref(algo)) != 0:
            return None
        return algo

    def capabilities(self, algo_id: int) -> dict[str, list[int] | int] | None:
        """What algorithm `algo_id` can be configured with (its tiles and stages, whether
        it splits K, its reduction schemes as a mask, its largest swizzle and custom
        option), or None where the library cannot initialize it for this product."""
        algo = self._initialized(algo_id)
        return None if algo is None else _capabilities_of(algo)

    def build(self, config: dict[str, int]) -> Candidate | None:
        """The algorithm of a configuration as `read_config` reads it (its `algo_id` and
        the attributes given), or None where the library refuses it for this product."""
        if "algo_id" not in config:
            raise ValueError(f"a configuration names its algo_id, got {config}")
        algo = self._initialized(config["algo_id"])
        if algo is None:
            return None
        return self._checked(algo, {key: value for key, value in config.items() if key != "algo_id"})

    def configurations(self, algo_id: int, stages: list[int] | None = None) -> list[Candidate]:
        """Every configuration of algorithm `algo_id` the library accepts for this product,
        K unsplit: each tile, custom option, swizzle and cluster shape it can take, with
        the stages given (the algorithm's own list where None; it can be long)."""
        initialized = self._initialized(algo_id)
        if initialized is None:
            return []
        caps = _capabilities_of(initialized)
        accepted = []
        for tile in caps["tiles"] or [0]:
            for stage in (caps["stages"] or [0]) if stages is None else stages:
                for custom in range(caps["custom"] + 1):
                    for swizzle in range(caps["swizzle"] + 1):
                        for cluster in range(CLUSTER_SHAPE_BOUND):
                            # A copy of the one initialized algorithm (the library's
                            # check of each, not its initialization, is what takes time:
                            # 2.7 s for 11,448 accepted of algorithm 66 on an H100).
                            candidate = self._checked(_copy(initialized), {
                                "tile": tile, "stages": stage, "custom": custom, "swizzle": swizzle,
                                "cluster_shape": cluster})
                            if candidate is not None:
                                accepted.append(candidate)
        return accepted

    def _checked(self, algo: _Algo, config: dict[str, int]) -> Candidate | None:
        lib = _lib()
        for key, value in config.items():
            attribute, ctype = CONFIG_ATTRIBUTES[key]
            raw = ctype(value)
            if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attribute, ctypes.byref(raw),
                                                        ctypes.sizeof(raw)) != 0:
                return None
        result = _HeuristicResult()
        if lib.cublasLtMatmulAlgoCheck(_handle(), self._desc, self._a, self._b, self._c, self._c,
                                       ctypes.byref(algo), ctypes.byref(result)) != 0:
            return None
        return Candidate(algo, int(result.workspace_size), read_config(algo))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, candidate: Candidate,
                 workspace: torch.Tensor | None) -> torch.Tensor:
        """out = x @ weight.T (out += x @ weight.T where accumulating), on the current stream."""
        m, n, k = self.shape
        if x.shape != (m, k) or weight.shape != (n, k) or out.shape != (m, n):
            raise ValueError(f"this product is [{m}, {k}] @ [{n}, {k}].T -> [{m}, {n}], got "
                             f"{tuple(x.shape)} @ {tuple(weight.shape)}.T -> {tuple(out.shape)}")
        if not (x.is_contiguous() and weight.is_contiguous() and out.is_contiguous()):
            raise ValueError("cuBLASLt products take contiguous operands")
        space = 0 if workspace is None else workspace.numel() * workspace.element_size()
        if candidate.workspace_bytes > space:
            raise ValueError(f"the algorithm needs {candidate.workspace_bytes} bytes of workspace, "
                             f"{space} given")
        _check(_lib().cublasLtMatmul(
            _handle(), self._desc, ctypes.byref(self._alpha), weight.data_ptr(), self._a, x.data_ptr(), self._b,
            ctypes.byref(self._beta), out.data_ptr(), self._c, out.data_ptr(), self._c, ctypes.byref(candidate.algo),
            None if workspace is None else workspace.data_ptr(), space,
            torch.cuda.current_stream(x.device).cuda_stream,
        ), "cublasLtMatmul")
        return out


def _copy(algo: _Algo) -> _Algo:
    """A copy of an algorithm's opaque struct, to configure without touching the original."""
    copy = _Algo()
    ctypes.memmove(ctypes.byref(copy), ctypes.byref(algo), ctypes.sizeof(_Algo))
    return copy


def read_config(algo: _Algo) -> dict[str, int]:
    """An algorithm's configuration attributes by name."""
    lib, config = _lib(), {}
    for key, (attribute, ctype) in CONFIG_ATTRIBUTES.items():
        value, written = ctype(0), ctypes.c_size_t(0)
        if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value),
                                                     ctypes.sizeof(value), ctypes.byref(written)) == 0:
            config[key] = int(value.value)
    return config


def _capabilities_of(algo: _Algo) -> dict[str, list[int] | int]:
    """An initialized algorithm's capabilities (`LtProduct.capabilities`)."""
    return {"tiles": _capability_list(algo, _CAP_TILE_IDS), "stages": _capability_list(algo, _CAP_STAGES_IDS),
            "split_k": _capability_int(algo, _CAP_SPLIT_K), "reductions": _capability_int(algo, _CAP_REDUCTION_MASK),
            "swizzle": _capability_int(algo, _CAP_SWIZZLING), "custom": _capability_int(algo, _CAP_CUSTOM_MAX)}


def _capability_int(algo: _Algo, attribute: int) -> int:
    value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
    if _lib().cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value),
                                                ctypes.sizeof(value), ctypes.byref(written)) != 0:
        return 0
    return int(value.value)


def _capability_list(algo: _Algo, attribute: int) -> list[int]:
    lib, written = _lib(), ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attribute, None, 0, ctypes.byref(written)) != 0:
        return []
    values = (ctypes.c_uint32 * (written.value // 4))()
    if values and lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attribute, values,
                                                        ctypes.sizeof(values), ctypes.byref(written)) != 0:
        return []
    return list(values)


def alignment_of(*tensors: torch.Tensor) -> int:
    """The alignment in bytes, up to 256, that all of `tensors`' addresses share (for
    `LtProduct.candidates`)."""
    address = 0
    for tensor in tensors:
        address |= tensor.data_ptr()
    return min(256, address & -address) if address else 256
