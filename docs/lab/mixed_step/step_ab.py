"""A 256-row prefill step (the mixed step's size) with its projections on cuBLAS against a
Triton tiled GEMM (64x128 tiles, so that o/down fill the GPU), in captured graphs."""
import json, pathlib, sys, torch, triton
sys.path.insert(0, ".")  # run from the repository root
from hybridd.bench.timing import captured_runner, prefill_step, stepper, median_time
from hybridd.model import load_model
from hybridd.kernels import triton_gemm, selection
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gemm_tiles import mm  # noqa: E402

CFG = {}  # set from argv: BM BN BK warps stages
def tiled(x, w, out=None, residual=None):
    m, k = x.shape; n = w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype) if out is None else out
    bm, bn, bk, nw, ns = CFG["cfg"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    mm[grid](x, w, out, out if residual is None else residual, m, n, k, BM=bm, BN=bn, BK=bk, GROUP=8,
             ADD=residual is not None, num_warps=nw, num_stages=ns)
    return out

orig_linear = triton_gemm.linear
def patched_linear(x, weight, bias=None):
    if x.is_cuda and x.shape[0] > triton_gemm.MAX_ROWS and bias is None and weight.dtype == torch.bfloat16:
        return tiled(x.contiguous(), weight)
    return orig_linear(x, weight, bias)
orig_linear_add = selection.TritonKernels.linear_add
def patched_linear_add(self, x, weight, bias, base):
    from hybridd.kernels.residual_stream import ResidualStream
    if self.norms_folded and x.shape[0] > triton_gemm.MAX_ROWS and bias is None and base.is_contiguous() \
            and weight.dtype == torch.bfloat16:
        tiled(x.contiguous(), weight, out=base, residual=base)
        return ResidualStream(base)
    return orig_linear_add(self, x, weight, bias, base)

orig_config_for = triton_gemm.config_for
def tile_config_for(m, n, k, multiprocessors, weight_bytes=2, shared_bytes=None):
    if m > triton_gemm.MAX_ROWS and weight_bytes == 2:
        bn, bk, bm, nw, ns = CFG["skinny"]
        return triton_gemm.GemmConfig(bn, bk, 1, nw, ns, block_m=bm, tile_m=True)
    return orig_config_for(m, n, k, multiprocessors, weight_bytes, shared_bytes)

model_dir, out = sys.argv[1], sys.argv[2]
cfgs = [(64, 128, 64, 4, 4), (64, 128, 64, 8, 4), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3)]
model = load_model(model_dir, dtype=torch.bfloat16, device="cuda")
res = {}
for rows in (128, 256, 512):
    skinny = [(128, 64, 64, 4, 4), (128, 64, 128, 8, 3), (64, 64, 64, 4, 4)]
    for variant in ["cublas"] + [f"tiled{c}" for c in cfgs] + [f"skinny{c}" for c in skinny]:
        triton_gemm.config_for = orig_config_for
        if variant.startswith("skinny"):
            CFG["skinny"] = eval(variant[6:]); triton_gemm.config_for = tile_config_for
            triton_gemm.linear = orig_linear; selection.TritonKernels.linear_add = orig_linear_add
        elif variant == "cublas":
            triton_gemm.linear = orig_linear; selection.TritonKernels.linear_add = orig_linear_add
        else:
            CFG["cfg"] = eval(variant[5:])
            triton_gemm.linear = patched_linear; selection.TritonKernels.linear_add = patched_linear_add
        try:
            runner = captured_runner(model, [1], [rows], width=64)
        except Exception as e:
            print(rows, variant, "failed", repr(e)[:300], flush=True); continue
        step = prefill_step(rows, list(range(rows // 16 + 1)))
        run = stepper(runner, step)
        t = median_time(run, 30, True, stream=runner.stream, per_round=5)
        captured = runner.stats[("prefill", rows)].captured
        res[f"{rows}.{variant}"] = {"ms": t * 1e3, "captured": captured}
        print(rows, variant, f"{t*1e3:.3f} ms", "captured" if captured else "EAGER", flush=True)
        del runner; torch.cuda.empty_cache()
json.dump(res, open(out, "w"), indent=1)
