"""Mid-row GEMMs (the mixed step's 128-512 rows): cuBLAS against Triton tile configs. `mm` (with
the residual added in its epilogue where ADD) is the Triton GEMM step_ab.py times in the whole step."""
import itertools, json, sys, torch, triton, triton.language as tl

@triton.jit
def mm(a_ptr, b_ptr, c_ptr, r_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
       GROUP: tl.constexpr, ADD: tl.constexpr):
    pid = tl.program_id(0)
    npm = tl.cdiv(M, BM); npn = tl.cdiv(N, BN)
    width = GROUP * npm
    gid = pid // width
    first_n = gid * GROUP
    gsize = min(npn - first_n, GROUP)
    pid_n = first_n + (pid % width) % gsize
    pid_m = (pid % width) // gsize
    rm = pid_m * BM + tl.arange(0, BM); rn = pid_n * BN + tl.arange(0, BN); rk = tl.arange(0, BK)
    a = a_ptr + rm[:, None] * K + rk[None, :]
    b = b_ptr + rn[:, None] * K + rk[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.)
        w = tl.load(b, mask=(rn[:, None] < N) & (rk[None, :] + k < K), other=0.)
        acc = tl.dot(x, tl.trans(w), acc)
        a += BK; b += BK
    c = c_ptr + rm[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ADD:
        acc += tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.).to(tl.float32)
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)

def graph_time(fn, reps=20, iters=5):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / reps * 1e3)
    return sorted(ts)[len(ts) // 2]  # us

SHAPES = {"7b": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)},
          "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}}
CONFIGS = [(bm, bn, bk, w, s) for bm, bn, bk, w, s in itertools.product((64, 128), (64, 128, 256), (64,), (4, 8), (3, 4, 5))
           if not (bm == 128 and bn == 256 and s > 3) and not (bn == 256 and w == 4)]

if __name__ == "__main__":
    out = {}
    for model, shapes in SHAPES.items():
        for m in (128, 256, 512):
            for name, (n, k) in shapes.items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
                y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                flops = 2 * m * n * k
                t_cub = graph_time(lambda: torch.mm(x, w.t(), out=y))
                t_add = graph_time(lambda: res.addmm_(x, w.t())) if name in ("o", "down") else None
                best = None
                ref = x.float() @ w.float().t()
                for cfg in CONFIGS:
                    bm, bn, bk, nw, ns = cfg
                    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
                    f = lambda: mm[grid](x, w, y, y, m, n, k, BM=bm, BN=bn, BK=bk, GROUP=8, ADD=False, num_warps=nw, num_stages=ns)
                    try:
                        f(); torch.cuda.synchronize()
                        assert (y.float() - ref).abs().max() < 0.05 * ref.abs().max()
                        t = graph_time(f)
                    except Exception:  # a config that does not fit or compile
                        continue
                    if best is None or t < best[0]: best = (t, cfg)
                row = {"cublas_us": t_cub, "cublas_tflops": flops / t_cub / 1e6, "addmm_us": t_add,
                       "triton_us": best[0], "triton_cfg": best[1], "triton_tflops": flops / best[0] / 1e6}
                out[f"{model}.{name}.{m}"] = row
                print(model, name, m, json.dumps(row), flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
