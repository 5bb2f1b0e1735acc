"""Which neighbours of a decode step's projections the skinny GEMM computes in its own
epilogue (`hybridd/kernels/triton_gemm.py`): the daemon's `gemm_fusions` setting
(`HYBRIDD_GEMM_FUSIONS`), a comma list of

- `norm`: the residual add and the RMSNorm: o_proj and down_proj add their output to the
  residual stream and leave each row's sum of squares in parts, and the next projection
  (qkv, gate/up), which holds the norm's weight (`LlamaModel.fold_norms`, done at load),
  scales each row of its product by the row's 1 / rms. An FP8 projection cannot hold the
  norm's weight (its scales are per output row): it applies the whole norm, weight
  included, to the activations as it loads them. Where cuBLAS takes a step's
  projections (more rows than the skinny kernel takes), cuBLAS adds o_proj's and
  down_proj's products to the stream and the kernels after qkv and gate/up (RoPE with
  the KV write, SiLU·mul) apply the row scales;
- `rotary`: RoPE of q and k and the KV-cache write, in the qkv projection's epilogue;
  not with an FP8 KV cache (`kv_cache_dtype = "fp8"`), whose write quantizes each head:
  there the separate RoPE kernel (`triton_ops.rotary_write_kv`) writes the cache;

or `none`. The fused kernels round in other places than the separate ones (the folded
weights, the product scaled after the sum); top-1 stays the same. The default, both, is
what measured fastest (docs/lab/kernels.md, "Fused neighbours"). A model gets its
fusions from the `KernelChoices` it is loaded with (`hybridd/kernels/choices.py`).
"""

from __future__ import annotations

KNOWN = ("norm", "rotary")
DEFAULT = "norm,rotary"


def parse(value: str, name: str = "gemm_fusions") -> frozenset[str]:
    """The fusions `value` names; raises ValueError, naming the setting, on anything else."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["none"]:
        return frozenset()
    if not names or any(n not in KNOWN for n in names):
        raise ValueError(f"{name} must be a comma list of {', '.join(KNOWN)} or 'none', got {value!r}")
    return frozenset(names)
