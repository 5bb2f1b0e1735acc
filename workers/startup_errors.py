"""Which start-up errors no restart can fix.

A model directory whose weights or tokenizer cannot be read, a configuration the
worker refuses, memory that is not there for the KV cache: a second pair would fail
the same way, so the worker reports the error to the supervisor (`worker_phase`
`failed`) and the supervisor exits with `exit_codes.STARTUP_FAILED` instead of
restarting. Anything else (a crash, a kill) keeps the backoff restarts.
"""

from __future__ import annotations


def is_permanent(error: BaseException) -> bool:
    import torch

    from hybridd.config import ConfigError
    from hybridd.model.errors import ModelLoadError

    return isinstance(error, ModelLoadError | ConfigError | MemoryError | torch.OutOfMemoryError)


def describe(worker: str, error: BaseException) -> str:
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return f"{worker} generator ran out of memory while starting ({str(error).splitlines()[0] if str(error) else 'no detail'}); " \
               "lower kv_cache_memory_fraction, num_kv_blocks or max_model_len"
    return f"{worker} generator: {error}"
