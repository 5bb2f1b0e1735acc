"""hybridd: a low-latency LLM inference daemon.

The static part of the Transformer forward is captured as CUDA Graphs per shape
bucket and replayed with one launch; the dynamic part (scheduling, KV blocks,
sampling, stop criteria) runs eagerly or JIT-compiled, in a second process.

The client SDK is exported here (`hybridd.Client`, `hybridd.AsyncClient` and the
exceptions); it is imported on first use so that the workers, which import
`hybridd.*` modules, do not pay for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridd.version import __version__

# The wheel installs ipc/, protocol/ and workers/ inside this package (hybridd.ipc, ...).
# Run from a source checkout without installing (PYTHONPATH=checkout, as on the GPU
# machine), they sit beside it: let the package find them there.
if not (Path(__file__).parent / "protocol").is_dir():
    __path__.append(str(Path(__file__).parent.parent))  # noqa: F821  (module __path__)

_CLIENT_EXPORTS = frozenset({
    "AsyncClient", "AsyncStream", "ChatMessage", "Choice", "Chunk", "Client", "GenerateResult", "Health",
    "SamplingParams", "Stream", "StructuredOutput", "TokenLogprob", "ToolCall", "ToolSpec", "TopLogprob",
})
_ERROR_EXPORTS = frozenset({
    "DaemonUnreachableError", "DrainingError", "EngineDeadError", "HandshakeRefusedError", "HybriddError",
    "InternalError", "InvalidRequestError", "NotFoundError", "OverloadedError", "RequestCancelledError",
    "RequestTimeoutError", "UnavailableError",
})
__all__ = sorted(_CLIENT_EXPORTS | _ERROR_EXPORTS | {"__version__"})

if TYPE_CHECKING:
    from hybridd.client import (
        AsyncClient,
        AsyncStream,
        ChatMessage,
        Choice,
        Chunk,
        Client,
        GenerateResult,
        Health,
        SamplingParams,
        Stream,
        StructuredOutput,
        TokenLogprob,
        ToolCall,
        ToolSpec,
        TopLogprob,
    )
    from hybridd.errors import (
        DaemonUnreachableError,
        DrainingError,
        EngineDeadError,
        HandshakeRefusedError,
        HybriddError,
        InternalError,
        InvalidRequestError,
        NotFoundError,
        OverloadedError,
        RequestCancelledError,
        RequestTimeoutError,
        UnavailableError,
    )


def __getattr__(name: str) -> Any:
    if name in _CLIENT_EXPORTS:
        from hybridd import client

        return getattr(client, name)
    if name in _ERROR_EXPORTS:
        from hybridd import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'hybridd' has no attribute {name!r}")
