"""The prefix-cache salt of a gateway request: the request's own `cache_salt`, or,
where the gateway salts by API key (`http_cache_salt_by_api_key`), a digest of the key
that authenticated the request combined with it.

Requests share cached KV blocks only under the same salt, so a tenant's salt keeps
its blocks, and the timing that would reveal another tenant's prompts, to itself. The
digest is fixed-length (it always fits the protocol's bound on a salt, whatever the
request's own salt) and never carries the key itself.
"""

from __future__ import annotations

import hashlib


def request_salt(api_key: str | None, cache_salt: str | None) -> str | None:
    """The salt to send for a request of `api_key` (None: not salted by key) whose body
    gave `cache_salt` (None: none)."""
    if api_key is None:
        return cache_salt
    digest = hashlib.sha256()
    for part in (api_key, cache_salt):
        # Length-prefixed, so that no (key, salt) pair reads as another.
        data = b"" if part is None else part.encode()
        digest.update(b"%d:%d:" % (part is not None, len(data)) + data)
    return digest.hexdigest()
