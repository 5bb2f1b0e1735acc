"""The kernel choices a model is loaded with: which kernel set runs its forward, which
neighbours the skinny projections fuse, and whether the fused kernels chain by
programmatic dependent launch. The daemon's settings (`kernels` as the program's
choice, `gemm_fusions`, `pdl`) become one `KernelChoices` that the graph generator hands
to `load_model`; nothing else decides them."""

from __future__ import annotations

from dataclasses import dataclass

from hybridd.kernels import gemm_fusions

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelChoices:
    """`backend`: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch";
    `fusions`: a subset of `gemm_fusions.KNOWN`; `pdl`: launch the fused kernels with
    programmatic dependent launch where the device supports it (`pdl.supported`)."""

    backend: str = "auto"
    fusions: frozenset[str] = gemm_fusions.parse(gemm_fusions.DEFAULT)
    pdl: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"kernels must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.fusions, frozenset) or not self.fusions <= set(gemm_fusions.KNOWN):
            raise ValueError(f"fusions must be a frozenset of {', '.join(gemm_fusions.KNOWN)}, got {self.fusions!r}")
        if not isinstance(self.pdl, bool):
            raise ValueError(f"pdl must be a bool, got {self.pdl!r}")

    @classmethod
    def from_settings(cls, backend: str = "auto", gemm_fusions_setting: str = gemm_fusions.DEFAULT,
                      pdl: bool = True) -> KernelChoices:
        """The choices of the daemon's settings (`gemm_fusions` as its comma list)."""
        return cls(backend, gemm_fusions.parse(gemm_fusions_setting), pdl)
