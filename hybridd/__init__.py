"""hybridd: a low-latency LLM inference daemon.

The static part of the Transformer forward is captured as CUDA Graphs per shape
bucket and replayed with one launch; the dynamic part (scheduling, KV blocks,
sampling, stop criteria) runs eagerly or JIT-compiled, in a second process.
"""

__version__ = "0.1.0"
