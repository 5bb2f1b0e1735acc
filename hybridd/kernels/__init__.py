"""The kernels of the forward and their launch choices: the torch reference (CPU and the
check of every GPU kernel), the fused Triton kernels, cuBLASLt, programmatic dependent
launch, and the selection of one set for a device. The model uses them; they import no
model."""
