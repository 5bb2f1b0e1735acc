"""The prefix cache turned off (`enable_prefix_caching = false`), against the two real
worker processes: a repeated prompt, salted or not, reports no cached tokens, status
says the cache is off and counts no hits, and the output is the same as the first time."""

from __future__ import annotations

import pytest

from tests.engine_pair import EnginePair
from tests.host_load import on_this_host

pytestmark = pytest.mark.slow
BLOCK = 16  # the default block_size
PROMPT = list(range(20, 20 + 3 * BLOCK + 5))  # three full blocks and a part
GREEDY = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with EnginePair(tmp_path_factory.mktemp("run"), device="cpu", dtype="float32",
                    enable_prefix_caching=False) as engine:
        yield engine


def test_no_tokens_are_reported_cached_when_the_prefix_cache_is_off(pair):
    client = pair.client(version=3)
    try:
        finals = []
        for salt in (None, None, "tenant-a", "tenant-a"):
            fields = {} if salt is None else {"cache_salt": salt}
            final, _ = client.generate(timeout=on_this_host(60), prompt_token_ids=PROMPT, stream=False,
                                       sampling=GREEDY, **fields)
            assert final["type"] == "final", final
            finals.append(final)
        status = client.request({"type": "status"}, timeout=on_this_host(30))["status"]
    finally:
        client.close()
    assert [f["usage"]["cached_tokens"] for f in finals] == [0, 0, 0, 0]
    assert all(f["usage"]["prompt_tokens"] == len(PROMPT) for f in finals)
    assert all(f["choices"] == finals[0]["choices"] for f in finals)
    cache = status["prefix_cache"]
    assert cache["enabled"] is False
    assert cache["hits"] == 0 and cache["cached_blocks"] == 0
