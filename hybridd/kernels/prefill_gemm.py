"""Projections of a prefill's rows on the cuBLASLt algorithm measured fastest for them.

A prefill of more than `triton_gemm.MAX_ROWS` tokens runs its projections on cuBLAS,
whose first heuristic choice reads some weights well below the copy bandwidth (the o
and down projections of Llama-2-7B at 128 rows: 58 % and 72 %). `scripts/bench_cublaslt.py`
times the algorithms cuBLASLt offers for each shape (the heuristic's, or with
`--exhaustive` every configuration its algorithms accept); where one beat PyTorch's call
clearly, `_TABLE` names its configuration by the GPU it was measured on, and the product
runs on it (`cublaslt.LtProduct`). Everywhere else, and wherever the library does not
offer that configuration (another cuBLAS version), PyTorch's call runs as before.

A split of K needs a workspace; it is allocated with the product, so a product captured
in a graph takes it from the graph's pool and one run eagerly (a capturing thread's
warm-up, beside the serving stream's replays) from the caching allocator: no two
products running at once share one.
"""

from __future__ import annotations

import functools
import threading

import structlog
import torch

log = structlog.get_logger(__name__)


def _lt(**config: int) -> dict[str, int]:
    """A configuration as `cublaslt.read_config` reads it: the attributes given, and K
    unsplit, no reduction, no swizzle, no custom option, the default inner shape."""
    return {"split_k": 1, "reduction": 0, "swizzle": 0, "custom": 0, "inner_shape": 0} | config


# (GPU name, rows, N, K, accumulate) -> the configuration of the algorithm to run, from
# `python scripts/bench_cublaslt.py --rows 128,64,256 --splits-of 2` on that GPU (cuBLAS
# of PyTorch 2.11 for CUDA 13): the cells where it beat PyTorch's call by 3 % or more.
# The H100's and the H200's entries for the products the model runs at 128 rows (qkv,
# gate/up, o and down added to the stream) are from the same script with `--exhaustive
# --limit 600` over those products. Its winners at 256 rows made the 256-token prefill
# step slower on the H200 and no faster on the H100 (scripts/bench_pdl_steps.py's
# `table=PATH`, docs/kernels.md), so those rows keep the first sweep's entries.
_TABLE: dict[tuple[str, int, int, int, bool], dict[str, int]] = {
    ('NVIDIA H100 80GB HBM3', 64, 4096, 14336, False):
        _lt(algo_id=66, tile=13, custom=3, stages=35, cluster_shape=5),
    ('NVIDIA H100 80GB HBM3', 64, 4096, 14336, True):
        _lt(algo_id=66, tile=13, custom=3, stages=35, cluster_shape=5),
    ('NVIDIA H100 80GB HBM3', 64, 22016, 4096, False):
        _lt(algo_id=66, tile=164, stages=35, cluster_shape=4),
    ('NVIDIA H100 80GB HBM3', 128, 4096, 11008, True):
        _lt(algo_id=66, tile=15, custom=2, stages=35, cluster_shape=5),
    ('NVIDIA H100 80GB HBM3', 128, 4096, 14336, False):
        _lt(algo_id=66, tile=15, custom=1, stages=35, cluster_shape=3),
    ('NVIDIA H100 80GB HBM3', 128, 4096, 14336, True):
        _lt(algo_id=66, tile=15, custom=1, stages=35, cluster_shape=2),
    ('NVIDIA H100 80GB HBM3', 128, 22016, 4096, False):
        _lt(algo_id=66, tile=28, custom=4, stages=35, cluster_shape=4),
    ('NVIDIA H100 80GB HBM3', 256, 4096, 4096, False):
        _lt(algo_id=66, tile=183, custom=2, stages=35, cluster_shape=9),
    ('NVIDIA H100 80GB HBM3', 256, 4096, 4096, True):
        _lt(algo_id=66, tile=183, custom=2, stages=35, cluster_shape=9),
    ('NVIDIA H100 80GB HBM3', 256, 4096, 11008, False):
        _lt(algo_id=66, tile=135, custom=2, stages=35, cluster_shape=7),
    ('NVIDIA H100 80GB HBM3', 256, 4096, 11008, True):
        _lt(algo_id=66, tile=135, custom=2, stages=35, cluster_shape=7),
    ('NVIDIA H100 80GB HBM3', 256, 4096, 14336, False):
        _lt(algo_id=66, tile=135, custom=2, stages=35, cluster_shape=7),
    ('NVIDIA H100 80GB HBM3', 256, 4096, 14336, True):
        _lt(algo_id=66, tile=135, custom=2, stages=35, cluster_shape=7),
    ('NVIDIA H200', 64, 4096, 11008, False):
        _lt(algo_id=66, tile=13, custom=3, stages=35, cluster_shape=5),
    ('NVIDIA H200', 64, 4096, 11008, True):
        _lt(algo_id=66, tile=13, custom=3, stages=35, cluster_shape=5),
    ('NVIDIA H200', 64, 4096, 14336, False):
        _lt(algo_id=66, tile=15, split_k=2, reduction=2, custom=1, stages=35, cluster_shape=3),
    ('NVIDIA H200', 64, 4096, 14336, True):
        _lt(algo_id=66, tile=15, split_k=2, reduction=2, custom=1, stages=35, cluster_shape=3),
    ('NVIDIA H200', 64, 12288, 4096, False):
        _lt(algo_id=66, tile=27, stages=35, cluster_shape=3),
    ('NVIDIA H200', 64, 22016, 4096, False):
        _lt(algo_id=66, tile=21, custom=1, stages=35, cluster_shape=4),
    ('NVIDIA H200', 64, 28672, 4096, False):
        _lt(algo_id=66, tile=18, custom=1, stages=35, cluster_shape=4),
    ('NVIDIA H200', 128, 4096, 4096, False):
        _lt(algo_id=66, tile=27, custom=2, stages=35, cluster_shape=7),
    ('NVIDIA H200', 128, 4096, 4096, True):
        _lt(algo_id=66, tile=15, stages=35, cluster_shape=2),
    ('NVIDIA H200', 128, 4096, 11008, True):
        _lt(algo_id=66, tile=15, stages=35, cluster_shape=5),
    ('NVIDIA H200', 128, 4096, 14336, True):
        _lt(algo_id=66, tile=15, custom=1, stages=35, cluster_shape=5),
    ('NVIDIA H200', 128, 22016, 4096, False):
        _lt(algo_id=66, tile=201, custom=6, stages=35, cluster_shape=2),
    ('NVIDIA H200', 128, 28672, 4096, False):
        _lt(algo_id=66, tile=165, custom=4, stages=35, cluster_shape=3),
    ('NVIDIA H200', 256, 4096, 4096, False):
        _lt(algo_id=66, tile=135, custom=2, stages=35, cluster_shape=7),
}
ENABLED = True
# The heuristic's search the table's algorithms come from (scripts/bench_cublaslt.py
# searches the same way): the workspace it may assume and how many candidates it names.
CANDIDATE_WORKSPACE_BYTES = 32 << 20
CANDIDATES = 64
_lock = threading.Lock()
# The operands' alignment the table's algorithms were chosen for (cuBLASLt's default).
_ALIGNMENT = 256


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _resolve(name: str, m: int, n: int, k: int, dtype: torch.dtype, accumulate: bool):
    """(the product, the candidate) for the table's entry, or None where the library
    does not offer its configuration."""
    from hybridd.kernels import cublaslt

    wanted = _TABLE[(name, m, n, k, accumulate)]
    product = cublaslt.LtProduct(m, n, k, dtype, accumulate=accumulate)
    # Built from its configuration alone, whether or not the heuristic would name it:
    # the algorithm the heuristic returns for a configuration is the same struct.
    built = product.build(wanted)
    if built is not None and built.config == wanted:
        return product, built
    log.warning("cublaslt_config_unavailable", rows=m, n=n, k=k, accumulate=accumulate, config=wanted)
    return None


def _product_for(x: torch.Tensor, weight: torch.Tensor, accumulate: bool, *others: torch.Tensor):
    """(the product, the candidate) for x @ weight.T, `others` being operands it also
    touches (the sum it adds to), or None where the table names none or an operand is
    not contiguous or not aligned as the named algorithm assumes."""
    if not (ENABLED and x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype):
        return None
    key = (_device_name(x.device.index or 0), x.shape[0], *weight.shape, accumulate)
    operands = (x, weight, *others)
    if key not in _TABLE or not all(t.is_contiguous() for t in operands):
        return None
    from hybridd.kernels import cublaslt

    if cublaslt.alignment_of(*operands) < _ALIGNMENT:
        return None
    with _lock:  # a capturing thread and the serving thread may resolve the same entry
        return _resolve(key[0], *key[1:4], x.dtype, accumulate)


def _workspace(candidate, device: torch.device) -> torch.Tensor | None:
    if not candidate.workspace_bytes:
        return None
    return torch.empty(candidate.workspace_bytes, dtype=torch.uint8, device=device)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight.T on the table's algorithm, or None where the table has none for it."""
    chosen = _product_for(x, weight, accumulate=False)
    if chosen is None:
        return None
    product, candidate = chosen
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return product(x, weight, out, candidate, _workspace(candidate, x.device))


def add_linear_(base: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """base += x @ weight.T in place on the table's algorithm; False (base untouched)
    where the table has none for it."""
    chosen = _product_for(x, weight, True, base)
    if chosen is None:
        return False
    product, candidate = chosen
    product(x, weight, base, candidate, _workspace(candidate, x.device))
    return True
