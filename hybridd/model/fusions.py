"""Which neighbours of a decode step's projections the skinny GEMM computes in its own
prologue or epilogue (`hybridd/model/triton_gemm.py`), from HYBRIDD_GEMM_FUSIONS: a comma
list of

- `norm`: the residual add and the RMSNorm; o_proj and down_proj add their output to the
  residual stream and leave each row's sum of squares in parts, and the next projection
  (qkv, gate/up) normalises its input rows as it loads them;
- `rotary`: RoPE of q and k and the KV-cache write, in the qkv projection's epilogue;
- `silu`: the MLP's SiLU·mul, in the gate/up projection's epilogue;

or `none`. Each fusion gives the bits of the separate kernels, but for the order of the
norm's float32 sum of squares. The default is what measured fastest on the H200 (see
docs/benchmarks.md, "Fused neighbours").
"""

from __future__ import annotations

import os

KNOWN = ("norm", "rotary", "silu")
DEFAULT = "norm,rotary"


def parse(value: str) -> frozenset[str]:
    """The fusions a HYBRIDD_GEMM_FUSIONS value names; raises on anything else."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["none"]:
        return frozenset()
    unknown = [n for n in names if n not in KNOWN]
    if unknown or not names:
        raise ValueError(
            f"HYBRIDD_GEMM_FUSIONS must be a comma list of {', '.join(KNOWN)} or 'none', got {value!r}"
        )
    return frozenset(names)


ENABLED: frozenset[str] = parse(os.environ.get("HYBRIDD_GEMM_FUSIONS", DEFAULT))
