"""The gateway's edges as off-the-shelf OpenAI clients meet them, against the real daemon
(`hybridd start --http-endpoint`, the embedded model): fields it does not use ignored
and named (refused under `strict_openai`), JSON errors with a code string on every
route, `/v1/models/{id}`, served-name aliases, `Retry-After`, 413, `X-Request-Id` into
the logs with an access line per request, CORS, and `/tokenize` / `/detokenize`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

import hybridd
from tests.daemon import free_port, wait_idle
from tests.gateway_daemon import API_KEY, GatewayDaemon, run_daemon_with_gateway, run_gateway, wait_listening
from tests.host_load import on_this_host

MODEL = "tiny-shakespeare"
ALIAS = "shakespeare"
ORIGIN = "http://app.example"
MAX_QUEUED = 2
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def daemon() -> Iterator[GatewayDaemon]:
    with run_daemon_with_gateway("--max-queued-requests", str(MAX_QUEUED), "--log-level", "info",
                                 "--served-model-name", f"{MODEL},{ALIAS}", "--http-cors-origins", ORIGIN) as running:
        yield running


@pytest.fixture(scope="module")
def oai(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _post(daemon: GatewayDaemon, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(daemon.url + path, content=content, headers=AUTH | {"content-type": "application/json"}
                      | (headers or {}), timeout=120)


def _wait_for_log(daemon: GatewayDaemon, pattern: str) -> str:
    """The daemon's log line matching `pattern`, once it is written."""
    end = time.monotonic() + on_this_host(30.0)
    while time.monotonic() < end:
        for line in daemon.log_path.read_text(errors="replace").splitlines():
            if re.search(pattern, line):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no log line matches {pattern!r}\n{daemon.log_path.read_text()[-4000:]}")


# ---------------------------------------------------------------- leniency


def test_no_op_and_unknown_fields_are_ignored_and_named(oai):
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Speak."}], max_tokens=4, temperature=0,
        store=False, metadata={"team": "a"}, user="u1", extra_body={"frobnicate": 3})
    completion = raw.parse()
    assert completion.choices[0].message.content is not None
    assert raw.headers["x-hybridd-ignored-fields"] == "frobnicate,metadata,store"


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/completions", {"echo": True, "logprobs": 1, "stream": True}, "echo"),
], ids=["functions", "json_schema-without-schema", "echo-logprobs-streamed"])
def test_what_hybridd_cannot_do_stays_refused(daemon, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2} | (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "ROMEO:"})
    response = _post(daemon, path, body | extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert isinstance(error["code"], str) and error["code"]


def test_strict_openai_refuses_what_it_does_not_use(daemon):
    port = free_port()
    with run_gateway(daemon.endpoint, "--http-endpoint", f"127.0.0.1:{port}", "--strict-openai") as (process, log):
        wait_listening(port, process, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2, extra_body={"store": True})
        assert caught.value.param == "store" and caught.value.code == "unsupported_field"
        assert client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2, user="u").choices


# ---------------------------------------------------------------- errors


def test_unknown_routes_and_methods_answer_openai_json(daemon):
    for response, status in ((httpx.get(daemon.url + "/v2/nothing", timeout=30), 404),
                             (httpx.post(daemon.url + "/v1/models", timeout=30), 405),
                             (httpx.get(daemon.url + "/v1/completions", timeout=30), 405)):
        assert response.status_code == status, response.text
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert error["code"] in ("not_found", "method_not_allowed") and error["message"]


@pytest.mark.parametrize(("path", "body", "headers", "status", "code"), [
    ("/v1/completions", {"model": MODEL, "prompt": "x"}, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, {}, 404, "model_not_found"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, {}, 400, "invalid_request"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, {}, 400, "invalid_request"),
    ("/v1/completions", b"{not json", {}, 400, "invalid_json"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, {}, 400, "invalid_request"),
], ids=["401", "404-model", "400-range", "400-type", "400-json", "400-messages"])
def test_every_error_has_a_code_string(daemon, path, body, headers, status, code):
    response = _post(daemon, path, body, headers)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_the_speculative_extension_field(daemon):
    """`speculative: false` (an extension) turns speculative decoding off for a request;
    the answer is the same; a value that is not a boolean is a 400 naming it."""
    body = {"model": MODEL, "prompt": "KING:", "max_tokens": 12, "temperature": 0}
    on, off = _post(daemon, "/v1/completions", body), _post(daemon, "/v1/completions", body | {"speculative": False})
    assert on.status_code == off.status_code == 200, off.text
    assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
    bad = _post(daemon, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                 "speculative": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative", bad.text


def test_a_body_over_the_limit_is_413(daemon):
    # Over the daemon's message limit, under the gateway's body limit: still the client's fault, in size.
    response = _post(daemon, "/v1/completions", {"model": MODEL, "prompt": "a" * (5 * 1024 * 1024), "max_tokens": 1})
    assert response.status_code == 413, response.text[:500]
    assert response.json()["error"]["code"]
    response = _post(daemon, "/v1/completions", b" " * (9 * 1024 * 1024))
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_overload_is_429_with_retry_after(daemon, oai):
    with hybridd.Client(daemon.endpoint, timeout=120) as sdk:
        streams = [sdk.stream("ROMEO:", max_tokens=1000, ignore_eos=True) for _ in range(MAX_QUEUED)]
        try:
            for stream in streams:
                next(stream)
            response = _post(daemon, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert response.status_code == 429, response.text
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == "overloaded"
        finally:
            for stream in streams:
                stream.close()
        assert wait_idle(sdk)["running"] == 0


def test_unavailable_is_503_with_retry_after(tmp_path):
    port = free_port()
    with run_gateway(f"ipc://{tmp_path}/nobody.sock", "--http-endpoint", f"127.0.0.1:{port}") as (process, log):
        wait_listening(port, process, log)
        for response in (httpx.get(f"http://127.0.0.1:{port}/health", timeout=30),
                         httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                                    json={"model": MODEL, "prompt": "x"})):
            assert response.status_code == 503, response.text
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == "unavailable"


# ---------------------------------------------------------------- models


def test_models_retrieve_and_aliases(oai):
    assert [m.id for m in oai.models.list().data] == [MODEL, ALIAS]
    assert oai.models.retrieve(MODEL).id == MODEL
    assert oai.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError) as caught:
        oai.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"
    completion = oai.completions.create(model=ALIAS, prompt="ROMEO:", max_tokens=3, temperature=0)
    assert completion.model == ALIAS and completion.choices[0].text


# ---------------------------------------------------------------- request ids and the access log


def test_request_id_is_returned_and_logged_with_an_access_line(daemon):
    response = _post(daemon, "/v1/completions", {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 5},
                     {"X-Request-Id": "trace-7f3a.1"})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "trace-7f3a.1"
    assert response.json()["id"] == "cmpl-trace-7f3a.1"
    line = _wait_for_log(daemon, r"request_id=.?trace-7f3a\.1\b.*status=.?200")
    for field in ("prompt_tokens=", "generated_tokens=5", "ttft_s=", "duration_s=", "finish_reason=.?length"):
        assert re.search(field, line), (field, line)
    generated = _post(daemon, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
                      {"X-Request-Id": "bad id with spaces"})
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])


def test_the_daemons_log_lines_for_a_request_carry_its_id(daemon):
    with httpx.stream("POST", daemon.url + "/v1/completions", headers=AUTH | {"X-Request-Id": "walkaway-42"},
                      json={"model": MODEL, "prompt": "ROMEO:", "max_tokens": 1000, "ignore_eos": True,
                            "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for _ in zip(range(3), response.iter_lines()):
            pass
    # The client walked away: the daemon's context generator aborts the request by the id it was given.
    line = _wait_for_log(daemon, r"request aborted.*request_id=\S*walkaway-42")
    assert "cancel" in line


# ---------------------------------------------------------------- CORS, tokenize


def test_cors_preflight_and_headers_for_the_configured_origin(daemon):
    preflight = httpx.options(daemon.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    models = httpx.get(daemon.url + "/v1/models", headers=AUTH | {"Origin": ORIGIN}, timeout=30)
    assert models.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(daemon.url + "/v1/models", headers=AUTH | {"Origin": "http://evil.example"}, timeout=30)
    assert "access-control-allow-origin" not in other.headers


def test_tokenize_and_detokenize_agree_with_the_daemon(daemon, oai):
    tokenized = _post(daemon, "/tokenize", {"model": MODEL, "prompt": "ROMEO: What light"})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    completion = oai.completions.create(model=MODEL, prompt="ROMEO: What light", max_tokens=1)
    assert body["count"] == len(body["tokens"]) == completion.usage.prompt_tokens
    assert body["max_model_len"] > 0
    plain = _post(daemon, "/tokenize", {"prompt": "ROMEO: What light", "add_special_tokens": False}).json()
    assert _post(daemon, "/detokenize", {"model": MODEL, "tokens": plain["tokens"]}).json() == \
        {"prompt": "ROMEO: What light"}
    bad = _post(daemon, "/detokenize", {"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
