"""The prefix cache over the wire, against the two real worker processes (raw pyzmq +
msgpack, protocol version 3): a repeated prompt reports its cached tokens and gives the
same output; another salt reports none; status counts the queries and hits."""

from __future__ import annotations

import os

import pytest

from tests.engine_pair import EnginePair

pytestmark = pytest.mark.slow
DEVICE = os.environ.get("HYBRIDD_TEST_DEVICE", "cpu")
BLOCK = 16  # the default block_size
PROMPT = list(range(20, 20 + 2 * BLOCK + 5))  # two full blocks and a part
GREEDY = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with EnginePair(tmp_path_factory.mktemp("run"), device=DEVICE, dtype="float32") as engine:
        yield engine


@pytest.fixture
def v3(pair):
    client = pair.client(version=3)
    yield client
    client.close()


def run(client, **fields) -> dict:
    final, _ = client.generate(prompt_token_ids=PROMPT, stream=False, sampling=GREEDY, **fields)
    assert final["type"] == "final", final
    return final


def test_a_repeated_prompt_reports_its_cached_tokens_and_another_salt_none(v3):
    before = v3.request({"type": "status"})["status"]["prefix_cache"]
    assert before["enabled"]
    cold = run(v3, cache_salt="tenant-a")
    warm = run(v3, cache_salt="tenant-a")
    other = run(v3, cache_salt="tenant-b")
    assert cold["usage"]["cached_tokens"] == 0
    assert warm["usage"]["cached_tokens"] == 2 * BLOCK
    assert other["usage"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens"] == len(PROMPT)
    assert warm["choices"] == cold["choices"] == other["choices"]
    after = v3.request({"type": "status"})["status"]["prefix_cache"]
    assert after["queries"] - before["queries"] == 3 * len(PROMPT)
    assert after["hits"] - before["hits"] == 2 * BLOCK


def test_version_2_finals_have_no_cached_tokens(pair):
    client = pair.client(version=2)
    try:
        final, _ = client.generate(prompt_token_ids=PROMPT, stream=False, sampling=GREEDY)
        assert final["v"] == 2 and set(final["usage"]) == {"prompt_tokens", "completion_tokens"}
        refused = client.request({"type": "generate", "prompt": "x", "cache_salt": "a"})
        assert refused["type"] == "error" and refused["field"] == "cache_salt"
    finally:
        client.close()
