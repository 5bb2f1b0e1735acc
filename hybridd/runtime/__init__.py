"""The static domain: step buffers, shape buckets, the graph runner and its kernels."""
