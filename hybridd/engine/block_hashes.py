"""The prefix cache's keys: a hash chain over a sequence's full KV blocks.

A full block's KV depends on every token before it, not only its own, so its key is
the hash of the previous block's key and its own token ids; the first block's parent
is a root derived from the request's `cache_salt`. Two sequences then share a block's
key exactly when they share every token up to its end and the salt, so two salts never
share a block. SHA-256, not Python's `hash`: a collision would silently hand one
request another's KV, and tenants must not be able to build one.
"""

from __future__ import annotations

import hashlib
from array import array
from functools import lru_cache

_ROOT_TAG = b"hybridd.kv-prefix.v1"
_ITEM_BYTES = array("q").itemsize


@lru_cache(maxsize=256)  # a few salts come again and again (none, a tenant's)
def chain_root(cache_salt: str | None) -> bytes:
    """The parent of a sequence's first block: distinct for every salt and for none."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    return hashlib.sha256(_ROOT_TAG + salt).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The key of a full block holding `token_ids`, after the block keyed `parent`."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, num_blocks: int,
                        cache_salt: str | None) -> None:
    """Append to `hashes` (the keys of the first blocks of `token_ids`) up to `num_blocks`
    keys; every one of those blocks must be full."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} full blocks of {block_size} need {num_blocks * block_size} tokens, "
                         f"got {len(token_ids)}")
    first = len(hashes)
    if first >= num_blocks:
        return
    parent = hashes[-1] if hashes else chain_root(cache_salt)
    # The new blocks' tokens as one buffer, each block's bytes sliced from it: the same
    # bytes `block_hash` hashes, without a conversion and a call per block (a prompt's
    # blocks are keyed on the way to its first token).
    data = array("q", token_ids[first * block_size:num_blocks * block_size]).tobytes()
    width = block_size * _ITEM_BYTES
    sha256 = hashlib.sha256
    for offset in range(0, len(data), width):
        parent = sha256(parent + data[offset:offset + width]).digest()
        hashes.append(parent)
