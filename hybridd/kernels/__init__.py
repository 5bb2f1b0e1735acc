"""The kernels of the forward and their launch choices: the torch reference (CPU and the
check of every GPU kernel), the fused Triton kernels, programmatic dependent launch,
and the choice of one set for a device (`choices`, `selection`). The model uses them; they import no
model."""
