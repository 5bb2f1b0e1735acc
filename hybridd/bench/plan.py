"""The parts' shared sizes: the prompt lengths and stream counts the daemon, the peers and
the report all speak of, and the daemon's variants (one setting changed each).

The run's own configuration (the parts' estimates, the presets' skips) is the CLI's (cli.py).
"""

TTFT_LENGTHS = (10, 32, 128, 256, 500)
ITL_PROMPT = 128

# The daemon with one setting changed, each timed against the `hybridd` part (the
# default): (its settings, what it changes, why it is skipped on the CPU).
VARIANTS = {
    "hybridd_no_mps": ({"cuda_mps": "off"}, "Without MPS", "MPS is a CUDA feature"),
    "hybridd_no_pdl": ({"pdl": False}, "Without PDL", "programmatic dependent launch is a CUDA feature"),
    "hybridd_unfused": ({"gemm_fusions": "none"}, "No fused neighbours", "the fusions are in the Triton projection"),
    # Polling keeps a core per worker busy: off by default, measured for a client that keeps the daemon busy.
    "hybridd_poll": ({"busy_poll_s": 0.05}, "Polling workers", "polling workers on the CPU take the forward's cores"),
    "hybridd_no_wake": ({"step_wake_poll_s": 0}, "No step wake-up",
                        "the wake-up it leaves out is a fraction of a CPU step"),
}

# The lengths a variant of the daemon measured beside the `hybridd` part is timed at.
BESIDE_TTFT_LENGTHS = (10, 128)

# Concurrent streams the `fp8` part times.
FP8_STREAMS = 32
# Concurrent streams the `speculation_client` part times.
SPEC_STREAMS = 32
