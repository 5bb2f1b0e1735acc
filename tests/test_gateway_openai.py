"""The HTTP gateway against the real daemon (`hybridd start --http-endpoint`, the
embedded model, its real workers), with the official `openai` package as the client.

One daemon serves the module (API keys on, a small queue so that overload is
reachable); the tests that stop things (gateway restart, drain) run last.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from pathlib import Path

import httpx
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

import hybridd
from hybridd.protocol.codec import REQUESTS, encode
from hybridd.protocol.errors import ErrorCode
from hybridd.protocol.messages import ErrorReply, GenerateRequest, HealthReply, HealthRequest
from tests.daemon import free_port, wait_idle
from tests.gateway_daemon import (
    API_KEY,
    GatewayDaemon,
    run_daemon_with_gateway,
    run_gateway,
    wait_listening,
)

MODEL = "tiny-shakespeare"
MAX_QUEUED = 6
LONG = {"max_tokens": 1000, "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon() -> Iterator[GatewayDaemon]:
    with run_daemon_with_gateway("--max-queued-requests", str(MAX_QUEUED)) as running:
        yield running


@pytest.fixture(scope="module")
def oai(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sdk(daemon) -> Iterator[hybridd.Client]:
    with hybridd.Client(daemon.endpoint, timeout=120) as client:
        yield client


# ---------------------------------------------------------------- completions


def test_models_lists_the_served_model(oai, daemon):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "hybridd"


def test_completion_matches_the_sdk(oai, sdk):
    completion = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0)
    direct = sdk.generate("ROMEO:", max_tokens=12, temperature=0)
    assert completion.object == "text_completion" and completion.model == MODEL
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.text == direct.text and choice.finish_reason == "length" and choice.index == 0
    assert completion.usage.prompt_tokens == direct.usage.prompt_tokens
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == direct.usage.prompt_tokens + 12


def test_streamed_completion_adds_up_to_the_whole_one(oai):
    whole = oai.completions.create(model=MODEL, prompt="JULIET:", max_tokens=16, temperature=0)
    chunks = list(oai.completions.create(model=MODEL, prompt="JULIET:", max_tokens=16, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_token_id_prompts_and_prompt_lists(oai, sdk):
    ids = sdk.generate("KING:", max_tokens=1).usage  # the prompt's length, for the check below
    completion = oai.completions.create(model=MODEL, prompt=["KING:", "QUEEN:"], max_tokens=5, temperature=0)
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].text == sdk.generate("KING:", max_tokens=5, temperature=0).text
    assert completion.usage.completion_tokens == 10
    tokens = [40, 41, 42]
    by_ids = oai.completions.create(model=MODEL, prompt=tokens, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == sdk.generate(tokens, max_tokens=4, temperature=0).text
    assert by_ids.usage.prompt_tokens == 3
    assert ids.prompt_tokens > 0


def test_n_choices_per_prompt_streamed_and_whole(oai):
    whole = oai.completions.create(model=MODEL, prompt=["ROMEO:", "JULIET:"], n=2, max_tokens=6, seed=7,
                                   temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in whole.choices) == [0, 1, 2, 3]
    assert whole.usage.completion_tokens == 4 * 6
    chunks = list(oai.completions.create(model=MODEL, prompt=["ROMEO:", "JULIET:"], n=2, max_tokens=6, seed=7,
                                         temperature=1.0, stream=True, extra_body={"ignore_eos": True}))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(4)}
    assert streamed == {c.index: c.text for c in whole.choices}  # seeded: the same four answers
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finals) == [0, 1, 2, 3]


def test_the_gateway_takes_its_replies_by_the_reply_ring(oai, daemon):
    """The gateway process's session has a reply ring (its AsyncClient asks for one on
    this host, as the SDK does): the daemon writes the streamed completion's replies
    into a ring; without one it would write none."""
    with hybridd.Client(daemon.endpoint, timeout=120, reply_ring=False) as plain:
        before = plain.status()["reply_rings"]["written"]
        stream = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=40, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        after = plain.status()["reply_rings"]["written"]
    assert after - before >= 20, (before, after)  # a chunk a step or so, and the final


def test_chat_completion_matches_the_sdk_chat(oai, sdk):
    messages = [{"role": "system", "content": "Enter ROMEO."}, {"role": "user", "content": "What light breaks?"}]
    completion = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    direct = sdk.chat(messages, max_tokens=12, temperature=0)
    assert completion.object == "chat.completion"
    (choice,) = completion.choices
    assert choice.message.role == "assistant" and choice.message.content == direct.text
    assert choice.finish_reason == direct.finish_reason
    assert completion.usage.prompt_tokens == direct.usage.prompt_tokens
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct.text
    assert chunks[-1].usage.completion_tokens == direct.usage.completion_tokens


def test_a_chat_answer_ends_with_its_speakers_turn(oai, sdk):
    """The embedded model writes speeches as its corpus does: each ends with a blank line,
    then the next speaker's name. Its generation_config.json declares that turn end
    (`chat_stop_strings`), so a chat's answer is one speech, not the scene that follows."""
    question = "What light through yonder window breaks?"
    running_on = sdk.generate(f"ROMEO:\n{question}\n\nJULIET:\n", max_tokens=60, temperature=0)
    speech, rest = running_on.text.split("\n\n", 1)
    assert rest.strip()  # the plain completion runs on into further speeches
    choice = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                         max_tokens=60, temperature=0).choices[0]
    assert (choice.message.content, choice.finish_reason) == (speech, "stop")


def _data_segments_received(sock: socket.socket) -> int:
    """Linux's count of the TCP segments with data that arrived on `sock` (tcp_info's
    tcpi_data_segs_in, at its fixed place in the kernel's append-only struct)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return int.from_bytes(info[152:156], "little")


def _post(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


@pytest.mark.parametrize("stream", [True, False])
def test_the_response_head_leaves_with_the_first_body_bytes(daemon, stream):
    """One write carries the status line, the headers and the first event (or the whole
    JSON body): the client reads its first token without a second read."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_post({"model": MODEL, "prompt": "ROMEO:", "max_tokens": 1, "stream": stream}))
        received = b""
        end = b"data: [DONE]\n\n\r\n0\r\n\r\n" if stream else b"}}"
        while not received.endswith(end):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        segments = _data_segments_received(sock)
    assert received.startswith(b"HTTP/1.1 200"), received
    # whole: head and body in one segment; streamed: head with the first event, the
    # finish event, then [DONE] with the end of the chunked body
    assert segments == (3 if stream else 1), (segments, received)


def test_chat_refuses_what_it_does_not_implement(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    functions=[{"name": "f", "parameters": {}}])
    assert caught.value.param == "functions"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=[])
    assert caught.value.param == "messages"


def _hf_log_softmax(prompt_ids: list[int], output_ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    from hybridd.config import EMBEDDED_MODEL

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(output_ids)].log_softmax(dim=-1)


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_logprobs_are_the_models_log_softmax(oai, sdk, stream):
    prompt = [40, 41, 42, 43]
    output = sdk.generate(prompt, max_tokens=8, temperature=0).token_ids
    expected = _hf_log_softmax(prompt, output)
    if stream:
        chunks = [c for c in oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                   logprobs=3, stream=True) if c.choices and c.choices[0].logprobs]
        token_logprobs = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
        top = [t for c in chunks for t in c.choices[0].logprobs.top_logprobs]
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    else:
        choice = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3).choices[0]
        token_logprobs, top, tokens = choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, choice.logprobs.tokens
        assert choice.logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert len(token_logprobs) == len(output) == 8
    for pos, (token, logprob) in enumerate(zip(output, token_logprobs, strict=True)):
        assert logprob == pytest.approx(float(expected[pos][token]), abs=2e-3), pos
        assert len(top[pos]) == 3 and max(top[pos].values()) == pytest.approx(logprob, abs=2e-3)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2).choices[0]
    assert len(chat.logprobs.content) == 4
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in chat.logprobs.content)


def test_n_choices_of_a_chat(oai):
    completion = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}], n=2,
                                             max_tokens=6, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.usage.completion_tokens == 12


def test_echo_prepends_the_prompt(oai):
    completion = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4, temperature=0, echo=True)
    plain = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4, temperature=0)
    assert completion.choices[0].text == "ROMEO:" + plain.choices[0].text


def test_echo_with_logprobs_leads_with_the_prompts_tokens(oai, sdk):
    """OpenAI's echo with logprobs: the prompt's tokens first (the first without a
    logprob), each logprob the model's log-softmax at the position before it."""
    prompt = "ROMEO:\nBut soft, what light"
    direct = sdk.generate(prompt, max_tokens=3, temperature=0, prompt_logprobs=2)
    choice = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                    logprobs=2).choices[0]
    assert choice.text == prompt + direct.text
    lp = choice.logprobs
    count = len(direct.prompt_logprobs)
    assert "".join(lp.tokens[:count]) == prompt and len(lp.tokens) == count + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[count] == len(prompt)
    # The daemon's values are checked against the model in test_runtime_chat_logprobs_n.
    for pos in range(1, count):
        assert lp.token_logprobs[pos] == pytest.approx(direct.prompt_logprobs[pos].logprob, abs=1e-5)
        assert len(lp.top_logprobs[pos]) <= 2


def test_prompt_logprobs_of_a_completion_and_a_chat(oai, sdk):
    """vLLM's prompt_logprobs: per prompt token, its id and the top alternatives' ids with
    logprob, rank and text (a completion's in each choice, a chat's beside the choices)."""
    completion = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2, temperature=0,
                                        extra_body={"prompt_logprobs": 1})
    direct = sdk.generate("ROMEO:", max_tokens=2, temperature=0, prompt_logprobs=1).prompt_logprobs
    entries = completion.choices[0].prompt_logprobs
    assert entries[0] is None and len(entries) == len(direct)
    for entry, want in zip(entries[1:], direct[1:], strict=True):
        mine = entry[str(want.token_id)]
        assert mine["logprob"] == pytest.approx(want.logprob, abs=1e-5) and mine["rank"] == want.rank
        assert mine["decoded_token"] == want.text and 1 <= len(entry) <= 2
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}], max_tokens=2,
                                       temperature=0, extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and all(len(e) == 1 for e in chat.prompt_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2, stream=True,
                               extra_body={"prompt_logprobs": 1})
    assert _error(refused)["param"] == "prompt_logprobs"


def test_stop_string_ends_the_completion_before_it(oai):
    free = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0).choices[0].text
    words = free.split()
    assert len(words) > 3, free
    stop = words[2]
    stopped = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0, stop=[stop, "zzzz"])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == free[: free.index(stop)]
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == choice.text


def test_seed_reproduces_a_sampled_completion(oai):
    def sample(seed: int) -> str:
        return oai.completions.create(model=MODEL, prompt="HAMLET:", max_tokens=24, temperature=1.0, top_p=0.95,
                                      seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_sampling_extensions_are_accepted(oai):
    completion = oai.completions.create(
        model=MODEL, prompt="ROMEO:", max_tokens=8, temperature=0.8, user="someone", presence_penalty=0.5,
        frequency_penalty=0.5, extra_body={"top_k": 20, "repetition_penalty": 1.1}, seed=3)
    assert completion.usage.completion_tokens == 8


# ---------------------------------------------------------------- errors


def _error(excinfo) -> dict:
    return excinfo.value.body if isinstance(excinfo.value.body, dict) else json.loads(excinfo.value.response.text)


def test_unsupported_field_is_refused_naming_it(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt="ROMEO:", logit_bias={"5": 10})
    assert caught.value.status_code == 400
    assert caught.value.param == "logit_bias" and "logit_bias" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt="ROMEO:", extra_body={"best_of": 3, "suffix": "x"})
    assert "best_of" in caught.value.message and "suffix" in caught.value.message


def test_invalid_values_are_400_naming_the_field(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt="ROMEO:", top_p=0)
    assert caught.value.param == "top_p" and caught.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=0)
    assert caught.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt=[1, 2, 10**9])
    assert caught.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt="ROMEO:", stream_options={"include_usage": True})
    assert caught.value.param == "stream_options"


def test_malformed_json_is_400(daemon):
    response = httpx.post(daemon.url + "/v1/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "ROMEO:"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "ROMEO:", "n": "two"}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "ROMEO:", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2.5]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1], ["x"]]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "ROMEO:", "stream": True, "stream_options": {"every": 1}},
     "stream_options"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "tone": "x"}]},
     "messages"),
])
def test_wrongly_typed_fields_are_400_naming_the_field(daemon, path, body, param):
    response = httpx.post(daemon.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: "), error["message"]


def test_oversized_body_is_413(daemon):
    from hybridd.gateway.app import MAX_BODY_BYTES

    body = b'{"model": "' + b"x" * MAX_BODY_BYTES + b'"}'
    response = httpx.post(daemon.url + "/v1/completions", content=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert response.status_code == 413
    assert str(MAX_BODY_BYTES) in response.json()["error"]["message"]


def test_other_methods_on_the_generation_routes_are_405(daemon):
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.get(daemon.url + path, headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 405 and response.headers["allow"] == "POST"
        assert "use POST" in response.json()["error"]["message"]


def test_api_key_missing_or_wrong_is_401(daemon):
    for key in ("wrong-key", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(daemon.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}, headers=headers)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=daemon.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(daemon.url + "/health").status_code == 200  # probes need no key


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as caught:
        oai.completions.create(model="gpt-4", prompt="ROMEO:")
    assert caught.value.status_code == 404 and caught.value.param == "model"


def test_overload_is_429(oai, sdk):
    streams = [sdk.stream("ROMEO:", **LONG) for _ in range(MAX_QUEUED)]
    try:
        for stream in streams:
            next(stream)
        with pytest.raises(openai.RateLimitError) as caught:
            oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4)
        assert caught.value.status_code == 429
        with pytest.raises(openai.RateLimitError):  # streaming: refused before the 200
            oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4, stream=True)
    finally:
        for stream in streams:
            stream.close()
    assert wait_idle(sdk)["running"] == 0


def test_health_named_the_lifecycle_state_while_starting(daemon):
    # The gateway is up long before the workers have loaded the model: its 503s said why.
    assert daemon.startup_states, "the gateway was never seen before the daemon was ready"
    assert set(daemon.startup_states) <= {"unavailable", "starting", "loading", "capturing"}, daemon.startup_states
    assert set(daemon.startup_states) & {"starting", "loading", "capturing"}, daemon.startup_states
    assert httpx.get(daemon.url + "/health").json() == {"status": "ok", "state": "ready"}


def test_gateway_without_a_daemon_is_503_with_the_state(tmp_path):
    port = free_port()
    with run_gateway(f"ipc://{tmp_path}/nobody.sock", "--http-endpoint", f"127.0.0.1:{port}") as (process, log):
        wait_listening(port, process, log)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["state"] == "unavailable"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=MODEL, prompt="ROMEO:")
        assert caught.value.status_code == 503
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 503


def test_workers_the_supervisor_calls_ready_but_the_gateway_cannot_reach_are_unavailable(tmp_path):
    """The supervisor's fallback endpoint says `ready` while the workers' socket does not
    answer the gateway: /health is 503 `unavailable`, never a 503 that says `ready`."""
    from hybridd.fallback_endpoint import fallback_endpoint

    port = free_port()
    endpoint = f"ipc://{tmp_path}/unreachable.sock"
    with supervisor_saying_ready(fallback_endpoint(endpoint)), \
            run_gateway(endpoint, "--http-endpoint", f"127.0.0.1:{port}") as (process, log):
        wait_listening(port, process, log)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.status_code == 503 and health.json()["error"]["state"] == "unavailable", health.text


@contextlib.contextmanager
def protocol_router(endpoint: str, answer: Callable[[Any], Any]) -> Iterator[str]:
    """A ROUTER at `endpoint` that decodes each request and sends back `answer(request)`
    (nothing when that is None): a stand-in for a daemon or a supervisor."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, frame = router.recv_multipart()
            reply = answer(REQUESTS.decode(frame))
            if reply is not None:
                router.send_multipart([identity, encode(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield endpoint
    finally:
        stop.set()
        thread.join()
        router.close(linger=0)
        context.term()


def supervisor_saying_ready(endpoint: str) -> contextlib.AbstractContextManager[str]:
    """The supervisor's fallback endpoint calling the workers ready (its lifecycle state)
    while it, not being them, does not serve: what the supervisor says."""
    return protocol_router(endpoint, lambda request: HealthReply(id=request.id, state="ready", ok=False)
                           if isinstance(request, HealthRequest) else None)


def daemon_that_fails(path: Path) -> contextlib.AbstractContextManager[str]:
    """A daemon that speaks the protocol and answers every generate with `internal`: the
    daemon's failure that the gateway must report as a 500."""

    def answer(request):
        if isinstance(request, HealthRequest):
            return HealthReply(id=request.id, state="ready", ok=True)
        if isinstance(request, GenerateRequest):
            return ErrorReply(id=request.id, code=ErrorCode.INTERNAL, message="the engine hit a bug", field=None)
        return None

    return protocol_router(f"ipc://{path}", answer)


def test_daemon_internal_error_is_500(tmp_path):
    port = free_port()
    with daemon_that_fails(tmp_path / "failing.sock") as endpoint, \
            run_gateway(endpoint, "--http-endpoint", f"127.0.0.1:{port}") as (process, log):
        wait_listening(port, process, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=MODEL, prompt="ROMEO:")
        assert caught.value.status_code == 500
        assert "the engine hit a bug" in caught.value.message
        assert caught.value.body["code"] == "internal"


# ---------------------------------------------------------------- disconnects


def _running(sdk: hybridd.Client) -> int:
    return sdk.status()["requests"]["running"]


def wait_running(sdk: hybridd.Client, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _running(sdk) != count:
        assert time.monotonic() < deadline, sdk.status()["requests"]
        time.sleep(0.01)


def test_disconnecting_a_stream_cancels_the_request(daemon, sdk):
    cancelled_before = sdk.status()["metrics"]["finished"]["cancelled"]
    body = {"model": MODEL, "prompt": "ROMEO:", "stream": True, **LONG}
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: dropping it would close the connection now
            next(lines)
            wait_running(sdk, 1)
    # the connection is closed: the engine stops the request
    assert wait_idle(sdk)["running"] == 0
    assert sdk.status()["metrics"]["finished"]["cancelled"] == cancelled_before + 1


def test_disconnecting_a_whole_request_cancels_it(daemon, sdk):
    cancelled_before = sdk.status()["metrics"]["finished"]["cancelled"]
    body = {"model": MODEL, "prompt": "ROMEO:", **LONG}
    done = threading.Event()

    def post() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(daemon.url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=3.0),
                       headers={"Authorization": f"Bearer {API_KEY}"})
        done.set()

    thread = threading.Thread(target=post)
    thread.start()
    wait_running(sdk, 1)
    thread.join(30)
    assert done.is_set()
    assert wait_idle(sdk)["running"] == 0
    assert sdk.status()["metrics"]["finished"]["cancelled"] == cancelled_before + 1


# ---------------------------------------------------------------- metrics


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, parsed by prometheus_client's parser."""
    response = httpx.get(url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def test_metrics_count_the_requests_and_tokens_served(daemon, oai, sdk):
    wait_idle(sdk)
    before = scrape(daemon.url)
    prompt_tokens = 0
    for prompt in ("ROMEO:", "JULIET:", "KING RICHARD:"):
        completion = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
        prompt_tokens += completion.usage.prompt_tokens
    chunks = list(oai.completions.create(model=MODEL, prompt="HAMLET:", max_tokens=7, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    prompt_tokens += chunks[-1].usage.prompt_tokens
    after = scrape(daemon.url)
    status = sdk.status()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("hybridd:request_success_total", finished_reason="length") == 4
    assert delta("hybridd:request_success_total", finished_reason="stop") == 0
    assert delta("hybridd:generation_tokens_total") == 3 * 5 + 7
    assert delta("hybridd:prompt_tokens_total") == prompt_tokens
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"hybridd:{histogram}_count") == 4, histogram
        assert value(after, f"hybridd:{histogram}_bucket", le="+Inf") == value(after, f"hybridd:{histogram}_count")
    assert delta("hybridd:inter_token_latency_seconds_count") == 3 * 4 + 6
    assert delta("hybridd:e2e_request_latency_seconds_sum") > 0
    assert value(after, "hybridd:num_requests_running") == 0 and value(after, "hybridd:num_requests_waiting") == 0
    # the same figures as `status`, which nothing changed since the scrape
    metrics = status["metrics"]
    assert value(after, "hybridd:generation_tokens_total") == metrics["generation_tokens"]
    assert value(after, "hybridd:prompt_tokens_total") == metrics["prompt_tokens"]
    assert value(after, "hybridd:num_preemptions_total") == status["requests"]["preemptions"]
    kv = status["kv_blocks"]
    assert value(after, "hybridd:kv_cache_usage_perc") == pytest.approx(kv["used"] / kv["total"])
    for bucket in status["buckets"]:
        labels = {"kind": bucket["kind"], "size": str(bucket["size"])}
        assert value(after, "hybridd:graph_replays_total", **labels) <= bucket["replays"]  # stats lag ≤ 1 s
        assert ("hybridd:graph_eager_runs_total", tuple(sorted({"model_name": MODEL, **labels}.items()))) in after
    assert value(after, "hybridd:graph_memory_bytes") == status["graph_bytes"]
    assert value(after, "hybridd:worker_restarts_total", worker="gateway") == 0
    assert value(after, "hybridd:graph_captures_total") >= 0


def test_metrics_endpoint_of_its_own_shows_the_same_figures(daemon, sdk):
    port = free_port()
    with run_gateway(daemon.endpoint, "--metrics-endpoint", f"127.0.0.1:{port}") as (process, log):
        wait_listening(port, process, log)
        wait_idle(sdk)
        own, gateway = scrape(f"http://127.0.0.1:{port}"), scrape(daemon.url)
        for name in ("hybridd:generation_tokens_total", "hybridd:prompt_tokens_total",
                     "hybridd:time_to_first_token_seconds_count"):
            assert value(own, name) == value(gateway, name) > 0
        # only /metrics (and /health) there: the API is not served on the metrics endpoint
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={}).status_code == 404


# ---------------------------------------------------------------- supervision (last: they stop things)


def test_status_lists_the_gateway_and_a_killed_gateway_is_restarted(daemon, sdk, oai):
    gateway = sdk.status()["workers"]["gateway"]
    assert gateway["pid"] > 0 and gateway["restarts"] == 0
    os.kill(gateway["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        now = sdk.status()["workers"]["gateway"]
        if now["restarts"] == 1 and now["pid"] not in (0, gateway["pid"]):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the gateway was not restarted: {sdk.status()['workers']}\n{daemon.log()}")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(daemon.url + "/health", timeout=2).status_code == 200:
                break
        time.sleep(0.1)
    assert oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=3).usage.completion_tokens == 3
    assert sdk.status()["workers"]["graph"]["restarts"] == 0  # the engine was not touched


def test_a_repeated_prompt_reports_cached_tokens(oai):
    prompt = "ROMEO: " + "But soft, what light through yonder window breaks? " * 4
    first = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 16
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # at least one full block of 16
    assert again.choices[0].text == first.choices[0].text


def test_draining_daemon_answers_503_then_exits(daemon, sdk, oai):
    stream = sdk.stream("ROMEO:", **LONG)
    next(stream)
    daemon.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while True:  # the supervisor tells the context generator; then new requests are refused
        try:
            oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=3)
        except openai.APIStatusError as error:
            assert error.status_code == 503 and error.body["code"] == "draining", error
            break
        assert time.monotonic() < deadline, "never refused while draining"
        time.sleep(0.05)
    health = httpx.get(daemon.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["error"]["state"] == "draining"
    stream.close()  # the last request ends; the drain completes
    assert daemon.process.wait(60) == 0
