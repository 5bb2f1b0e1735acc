"""Inter-process plumbing: shared arenas, interprocess events, ZeroMQ channels."""
