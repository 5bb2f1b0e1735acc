"""cuBLASLt products with a chosen algorithm (`hybridd.kernels.cublaslt`) and the prefill
projections that run on them (`hybridd.kernels.prefill_gemm`), against `F.linear`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridd.kernels import prefill_gemm

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="cuBLASLt needs CUDA")
WORKSPACE = 32 << 20


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_sweep_writes_each_configuration_as_the_table_holds_it():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_cublaslt import table_source

    for config in prefill_gemm._TABLE.values():
        assert eval(table_source(config), {"_lt": prefill_gemm._lt}) == config  # noqa: S307 (our own output)
    assert table_source(prefill_gemm._lt(algo_id=66, tile=27, stages=35)) == "_lt(algo_id=66, tile=27, stages=35)"


def test_prefill_gemm_leaves_cpu_products_to_torch():
    x, w = torch.randn(128, 64), torch.randn(96, 64)
    base = torch.zeros(128, 96)
    assert prefill_gemm.linear(x, w) is None
    assert prefill_gemm.add_linear_(base, x, w) is False and not base.any()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("m", "n", "k"), [(128, 4096, 4096), (64, 4096, 11008), (256, 12288, 4096), (77, 336, 200)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_every_candidate_matches_torch(m, n, k, accumulate):
    """Each algorithm the heuristic names, and K split in the first, computes the product
    (added in place to the output where accumulating), eagerly and replayed from a graph."""
    from hybridd.kernels import cublaslt

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=g)
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda", generator=g) / k**0.5
    base = torch.randn(m, n, dtype=torch.bfloat16, device="cuda", generator=g)
    reference = F.linear(x, w) + (base if accumulate else 0)
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    product = cublaslt.LtProduct(m, n, k, torch.bfloat16, accumulate=accumulate)
    found = product.candidates(WORKSPACE, count=16)
    assert found, "the heuristic named no algorithm"
    split = product.variant(found[0], split_k=2, reduction=2)
    for candidate in found + ([split] if split is not None else []):
        out = base.clone()
        product(x, w, out, candidate, workspace)
        assert rel(out, reference) < 1e-2, candidate.describe()
    out = base.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        product(x, w, out, found[-1], workspace)
    out.copy_(base)
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, reference) < 1e-2


@pytest.mark.gpu
@gpu
def test_configurations_beyond_the_heuristic_build_check_and_compute_the_product():
    """An algorithm's capabilities enumerate configurations the library accepts; the
    heuristic's first is among them, a configuration read back builds the same algorithm,
    each built one computes the product, and one the library refuses builds None."""
    from hybridd.kernels import cublaslt

    m, n, k = 128, 1024, 512
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    reference = F.linear(x, w)
    product = cublaslt.LtProduct(m, n, k, torch.bfloat16)
    first = product.candidates(WORKSPACE, count=8)[0]
    assert first.config["algo_id"] in product.algo_ids()
    caps = product.capabilities(first.config["algo_id"])
    assert caps is not None and first.config["tile"] in (caps["tiles"] or [0])
    accepted = product.configurations(first.config["algo_id"], stages=[first.config["stages"]])
    unsplit = {key: value for key, value in first.config.items() if key not in ("split_k", "reduction")}
    configs = [{key: c.config[key] for key in unsplit} for c in accepted]
    assert unsplit in configs, f"{first.describe()} not among {len(accepted)} enumerated"
    rebuilt = product.build(first.config)
    assert rebuilt is not None and rebuilt.config == first.config
    # What `prefill_gemm` relies on to build its entries alone: a configuration built
    # from what is read back is the very struct the heuristic returned, split or not.
    named = product.candidates(WORKSPACE, count=8)
    split = product.variant(first, split_k=2, reduction=2)
    for candidate in named + ([split] if split is not None else []):
        built = product.build(candidate.config)
        assert built is not None and bytes(built.algo) == bytes(candidate.algo), candidate.describe()
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    for candidate in [rebuilt, *accepted[:: max(1, len(accepted) // 12)]]:
        if candidate.workspace_bytes > WORKSPACE:
            continue
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        product(x, w, out, candidate, workspace)
        assert rel(out, reference) < 1e-2, candidate.describe()
    assert product.build({**first.config, "tile": 10**6}) is None
    assert product.capabilities(-5) is None
    with pytest.raises(ValueError, match="algo_id"):
        product.build({"tile": first.config["tile"]})


@pytest.mark.gpu
@gpu
def test_a_table_entry_the_heuristic_does_not_name_is_built(monkeypatch):
    """A table entry whose configuration is not among the heuristic's candidates (an
    enumerated one) resolves by building it, and the product on it equals PyTorch's."""
    from hybridd.kernels import cublaslt

    m, n, k = 96, 512, 256
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    product = cublaslt.LtProduct(m, n, k, torch.bfloat16)
    named = product.candidates(prefill_gemm.CANDIDATE_WORKSPACE_BYTES, count=prefill_gemm.CANDIDATES)
    first = named[0]
    names = {tuple(sorted(c.config.items())) for c in named}
    unnamed = [c for c in product.configurations(first.config["algo_id"], stages=[first.config["stages"]])
               if tuple(sorted(c.config.items())) not in names and not c.workspace_bytes]
    if not unnamed:
        pytest.skip("every accepted configuration is among the heuristic's candidates here")
    name = torch.cuda.get_device_name(0)
    monkeypatch.setattr(prefill_gemm, "_TABLE", {(name, m, n, k, False): unnamed[0].config})
    prefill_gemm._resolve.cache_clear()
    try:
        resolved = prefill_gemm._resolve(name, m, n, k, torch.bfloat16, False)
        assert resolved is not None and resolved[1].config == unnamed[0].config
        y = prefill_gemm.linear(x, w)
        assert y is not None and rel(y, F.linear(x, w)) < 1e-2
    finally:
        prefill_gemm._resolve.cache_clear()


@pytest.mark.gpu
@gpu
def test_a_product_refuses_operands_of_another_shape():
    from hybridd.kernels import cublaslt

    product = cublaslt.LtProduct(64, 256, 128, torch.bfloat16)
    x = torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(256, 120, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"\[64, 128\] @ \[256, 128\]\.T -> \[64, 256\], got \(64, 128\) @ \(256, 120\)"):
        product(x, w, torch.zeros(64, 256, dtype=torch.bfloat16, device="cuda"), None, None)
    with pytest.raises(ValueError, match="take"):
        cublaslt.LtProduct(64, 256, 128, torch.int8)


@pytest.mark.gpu
@gpu
def test_table_entry_runs_its_algorithm_and_an_unknown_one_falls_back(monkeypatch):
    """A table entry for this GPU runs the product on the named configuration; an entry
    naming a configuration the library does not offer leaves the product to PyTorch."""
    from hybridd.kernels import cublaslt

    m, n, k = 96, 512, 256
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    name = torch.cuda.get_device_name(0)
    found = cublaslt.LtProduct(m, n, k, torch.bfloat16).candidates(WORKSPACE, count=8)
    split = cublaslt.LtProduct(m, n, k, torch.bfloat16, accumulate=True).variant(found[0], split_k=2, reduction=2)
    table = {(name, m, n, k, False): found[-1].config}
    if split is not None:
        table[(name, m, n, k, True)] = split.config
    monkeypatch.setattr(prefill_gemm, "_TABLE", table)
    prefill_gemm._resolve.cache_clear()
    y = prefill_gemm.linear(x, w)
    assert y is not None and rel(y, F.linear(x, w)) < 1e-2
    assert prefill_gemm._resolve.cache_info().currsize == 1
    if split is not None:
        base = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
        expected = base + F.linear(x, w)
        assert prefill_gemm.add_linear_(base, x, w) and rel(base, expected) < 1e-2
    assert prefill_gemm.linear(x[:64], w) is None  # no entry for 64 rows

    monkeypatch.setattr(prefill_gemm, "_TABLE", {(name, m, n, k, False): {**found[0].config, "tile": 10**6}})
    prefill_gemm._resolve.cache_clear()
    assert prefill_gemm.linear(x, w) is None
    prefill_gemm._resolve.cache_clear()


@pytest.mark.gpu
@gpu
def test_every_table_entry_of_this_gpu_resolves_and_matches_torch():
    """Each entry measured on this GPU names an algorithm this cuBLAS offers, and the
    product on it equals PyTorch's (added in place where the entry accumulates)."""
    name = torch.cuda.get_device_name(0)
    entries = [key for key in prefill_gemm._TABLE if key[0] == name]
    if not entries:
        pytest.skip(f"the table has no entries for {name}")
    prefill_gemm._resolve.cache_clear()
    for _, m, n, k, accumulate in entries:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        if accumulate:
            base = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
            expected = base + F.linear(x, w)
            assert prefill_gemm.add_linear_(base, x, w), (m, n, k, accumulate)
            assert rel(base, expected) < 1e-2
        else:
            y = prefill_gemm.linear(x, w)
            assert y is not None, (m, n, k, accumulate)
            assert rel(y, F.linear(x, w)) < 1e-2
