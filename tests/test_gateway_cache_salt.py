"""Prefix-cache salts end to end: requests share cached KV blocks only under the same
salt, whether the salt comes from the request (`cache_salt` in either OpenAI body, or
the SDK's keyword, both faces) or from the API key that authenticated it
(`http_cache_salt_by_api_key`), so that two tenants never share a block.

One real daemon (`hybridd start`, the embedded model, its real workers) serves the
module: its own gateway salts by API key (two keys), and a second gateway process
without keys (`python -m hybridd.gateway.process`) passes requests' salts through
unchanged. What a request shared is its `usage.prompt_tokens_details.cached_tokens`
(the final's `usage.cached_tokens` through the SDK).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import pytest

import hybridd
from hybridd.gateway.cache_salt import request_salt
from tests.daemon import free_port
from tests.gateway_daemon import API_KEY, GatewayDaemon, run_daemon_with_gateway, run_gateway, wait_listening

pytestmark = pytest.mark.slow
MODEL = "tiny-shakespeare"
OTHER_KEY = "sk-test-other-tenant-9876"
BLOCK = 16  # the default block_size
GREEDY = {"max_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def daemon() -> Iterator[GatewayDaemon]:
    with run_daemon_with_gateway("--http-cache-salt-by-api-key", keys=(API_KEY, OTHER_KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def unsalted_url(daemon) -> Iterator[str]:
    """A gateway without API keys in front of the same daemon: salts come from requests alone."""
    port = free_port()
    with run_gateway(daemon.endpoint, "--http-endpoint", f"127.0.0.1:{port}") as (process, log):
        wait_listening(port, process, log)
        yield f"http://127.0.0.1:{port}"


def prompt() -> str:
    """A prompt of several full blocks that no other test sends (its first words differ)."""
    return f"Citizen {uuid.uuid4().hex}: " + "we are accounted poor citizens, the patricians good. " * 6


def cached(url: str, text: str, *, key: str | None = None, salt: str | None = None, chat: bool = False) -> int:
    """The prompt tokens the prefix cache held for one request through the gateway at `url`."""
    body: dict = {"model": MODEL, **GREEDY}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = httpx.post(url + path, json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] > 3 * BLOCK  # several full blocks could be shared
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_two_api_keys_never_share_a_block_and_one_key_does(daemon, chat):
    text = prompt()
    assert cached(daemon.url, text, key=API_KEY, chat=chat) == 0
    warm = cached(daemon.url, text, key=API_KEY, chat=chat)
    assert warm >= 3 * BLOCK and warm % BLOCK == 0
    # The other tenant's same prompt finds nothing, then its own blocks.
    assert cached(daemon.url, text, key=OTHER_KEY, chat=chat) == 0
    assert cached(daemon.url, text, key=OTHER_KEY, chat=chat) == warm


def test_a_requests_salt_divides_its_tenants_share_and_no_salt_reaches_another_tenant(daemon):
    text = prompt()
    assert cached(daemon.url, text, key=API_KEY, salt="team-1") == 0
    assert cached(daemon.url, text, key=API_KEY, salt="team-1") > 0
    assert cached(daemon.url, text, key=API_KEY) == 0  # the tenant's unsalted share is another
    assert cached(daemon.url, text, key=API_KEY, salt="team-2") == 0
    # The same request salt under another key is that key's own.
    assert cached(daemon.url, text, key=OTHER_KEY, salt="team-1") == 0


def test_a_tenant_cannot_reach_another_tenants_blocks_by_sending_its_salt(daemon):
    """The salt the gateway sends for a key, given as a request's salt under another key,
    is salted again by that key."""
    text = prompt()
    assert cached(daemon.url, text, key=API_KEY) == 0
    assert cached(daemon.url, text, key=API_KEY) > 0
    assert cached(daemon.url, text, key=OTHER_KEY, salt=request_salt(API_KEY, None)) == 0


def test_request_salts_pass_through_a_gateway_without_keys_and_meet_the_sdks(daemon, unsalted_url):
    text = prompt()
    assert cached(unsalted_url, text, salt="a") == 0
    assert cached(unsalted_url, text, salt="a") > 0
    assert cached(unsalted_url, text, salt="b") == 0
    assert cached(unsalted_url, text) == 0
    with hybridd.Client(daemon.endpoint, timeout=120) as client:
        # The SDK's request under the same salt shares the gateway's blocks; another salt does not.
        assert client.generate(text, cache_salt="a", **GREEDY).usage.cached_tokens > 0
        assert client.generate(text, cache_salt="c", **GREEDY).usage.cached_tokens == 0
        assert client.generate(text, **GREEDY).usage.cached_tokens > 0  # the unsalted share, sent above


def test_both_sdk_faces_salt_generate_stream_chat_and_chat_stream(daemon):
    text = prompt()
    messages = [{"role": "user", "content": text}]
    with hybridd.Client(daemon.endpoint, timeout=120) as client:
        assert client.generate(text, cache_salt="s1", **GREEDY).usage.cached_tokens == 0
        stream = client.stream(text, cache_salt="s1", **GREEDY)
        for _ in stream:
            pass
        assert stream.result is not None and stream.result.usage.cached_tokens > 0
        assert client.chat(messages, cache_salt="s1", **GREEDY).usage.cached_tokens == 0
        chat_stream = client.chat_stream(messages, cache_salt="s1", **GREEDY)
        for _ in chat_stream:
            pass
        assert chat_stream.result is not None and chat_stream.result.usage.cached_tokens > 0

    async def async_face() -> tuple[int, int, int, int]:
        async with hybridd.AsyncClient(daemon.endpoint, timeout=120) as client:
            other = await client.generate(text, cache_salt="s2", **GREEDY)
            same = await client.chat(messages, cache_salt="s1", **GREEDY)
            stream = client.stream(text, cache_salt="s2", **GREEDY)
            async for _ in stream:
                pass
            chat_stream = client.chat_stream(messages, cache_salt="s3", **GREEDY)
            async for _ in chat_stream:
                pass
            assert stream.result is not None and chat_stream.result is not None
            return (other.usage.cached_tokens, same.usage.cached_tokens, stream.result.usage.cached_tokens,
                    chat_stream.result.usage.cached_tokens)

    other, same, streamed, new_chat = asyncio.run(async_face())
    assert other == 0 and same > 0 and streamed > 0 and new_chat == 0


@pytest.mark.parametrize("salt", ["", "x" * 257, 7])
def test_a_bad_salt_is_refused_naming_it(daemon, salt):
    response = httpx.post(daemon.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "cache_salt": salt},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"
    with hybridd.Client(daemon.endpoint, timeout=60) as client, pytest.raises(hybridd.HybriddError) as error:
        client.generate("hi", cache_salt=salt, max_tokens=1)
    assert error.value.field == "cache_salt"
