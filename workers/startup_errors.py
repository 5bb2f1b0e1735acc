"""Which start-up errors no restart can fix.

A model directory whose weights or tokenizer cannot be read, a configuration the
worker refuses, memory that is not there for the KV cache: a second pair would fail
the same way, so the worker reports the error to the supervisor (`worker_phase`
`failed`) and the supervisor exits with `exit_codes.STARTUP_FAILED` instead of
restarting. Anything else (a crash, a kill) keeps the backoff restarts.
"""

from __future__ import annotations

import errno


def _out_of_memory(error: BaseException) -> bool:
    import torch

    # Shared memory (the KV cache and step arenas on a CPU host) that /dev/shm cannot hold.
    no_room = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.ENOMEM)
    return no_room or isinstance(error, MemoryError | torch.OutOfMemoryError)


def is_permanent(error: BaseException) -> bool:
    from hybridd.config import ConfigError
    from hybridd.model.errors import ModelLoadError

    return isinstance(error, ModelLoadError | ConfigError) or _out_of_memory(error)


def describe(worker: str, error: BaseException) -> str:
    if _out_of_memory(error):
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        return (f"{worker} generator ran out of memory while starting ({detail}); "
                "lower kv_cache_memory_fraction, num_kv_blocks or max_model_len")
    return f"{worker} generator: {error}"
