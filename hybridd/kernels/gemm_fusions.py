"""Which neighbours of a decode step's projections the skinny GEMM computes in its own
epilogue (`hybridd/kernels/triton_gemm.py`): the daemon's `gemm_fusions` setting
(`HYBRIDD_GEMM_FUSIONS`), a comma list of

- `norm`: the residual add and the RMSNorm: o_proj and down_proj add their output to the
  residual stream and leave each row's sum of squares in parts, and the next projection
  (qkv, gate/up), which holds the norm's weight (`LlamaModel.fold_norms`, done at load),
  scales each row of its product by the row's 1 / rms. Where cuBLAS takes a step's
  projections (more rows than the skinny kernel takes), cuBLAS adds o_proj's and
  down_proj's products to the stream and the kernels after qkv and gate/up (RoPE with
  the KV write, SiLU·mul) apply the row scales;
- `rotary`: RoPE of q and k and the KV-cache write, in the qkv projection's epilogue;
- `silu`: the MLP's SiLU·mul, in the gate/up projection's epilogue;
- `mlp`: with `norm`, the whole MLP of a step of up to 16 rows as one persistent kernel
  (gate/up with its norm and SiLU·mul, a grid barrier, down with the residual add;
  `hybridd/kernels/triton_mlp.py`) instead of three;

or `none`. The fused kernels round in other places than the separate ones (the folded
weights, the product scaled after the sum); top-1 stays the same. The default is what
measured fastest on the H200 (docs/kernels.md, "Fused neighbours"): the norm saves
about 0.1 ms of a 7B decode step, and RoPE with the KV write (one kernel fewer a layer)
about 1 % more with programmatic dependent launch on (nothing without it); SiLU·mul is
slower, and the MLP as one kernel (on an H100) within a percent of its three, faster
for Llama-2-7B and slower for Llama-3-8B. The graph generator sets `ENABLED` from its
configuration before it loads the model; a program that loads a model itself may set it
too.
"""

from __future__ import annotations

KNOWN = ("norm", "rotary", "silu", "mlp")
DEFAULT = "norm,rotary"


def parse(value: str, name: str = "gemm_fusions") -> frozenset[str]:
    """The fusions `value` names; raises ValueError, naming the setting, on anything else."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["none"]:
        return frozenset()
    if not names or any(n not in KNOWN for n in names):
        raise ValueError(f"{name} must be a comma list of {', '.join(KNOWN)} or 'none', got {value!r}")
    if "mlp" in names and "norm" not in names:
        raise ValueError(f"{name} {value!r}: mlp takes the norm from the stream's sums of squares, so it needs norm")
    return frozenset(names)


ENABLED: frozenset[str] = parse(DEFAULT)
