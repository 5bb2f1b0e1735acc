"""Host marks (hybridd/runtime/step_trace.py) through the real two-process pair on the
CPU: scripts/trace_requests.py sends requests, both workers write their marks, and each
request's milestones come out in the order the request passes them, on the client's clock."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.host_load import on_this_host

ROOT = Path(__file__).resolve().parent.parent

# The path of a request's first token, in the order it is taken. A mark before a send
# ("_send") precedes its receipt in the other process even when the host is busy.
FIRST_TOKEN_PATH = [
    "context.frame_received", "context.expect_send", "context.admitted", "context.scheduled", "context.inputs_ready",
    "context.step_send", "graph.step_received", "graph.graph_launch", "graph.graph_launched",
    "graph.launched_send", "context.launched_seen", "context.sampling_enqueued", "context.tokens_on_host",
    "context.chunk_send", "client.first_chunk",
]


@pytest.mark.slow
def test_each_request_passes_its_milestones_in_order(tmp_path):
    out = subprocess.run(
        # No --model: the script makes its random checkpoint of the preset's shape, on the CPU here.
        [sys.executable, "-m", "scripts.trace_requests", "--out", str(tmp_path), "--device", "cpu",
         "--preset", "small", "--requests", "10", "--warmup-requests",
         "2", "--gap-ms", "0", "--max-tokens", "3", "--client-spin", "alternate",
         # A poll window longer than a request: each request from idle is announced all the same.
         "--config", '{"step_wake_poll_s": 1.0}'],
        capture_output=True, text=True, timeout=on_this_host(300), cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    marks = {p.name.split("-")[1]: json.loads(p.read_text()) for p in tmp_path.glob("marks-*.json")}
    assert set(marks) == {"context", "graph"}
    assert all(m["clock"] == "perf_counter_ns" for m in marks.values())
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    traced = timeline[2:12]
    assert [r["spin"] for r in traced] == [False, True] * 5  # every other request polls
    context = sorted(ns for _, _, ns in marks["context"]["marks"])
    graph = sorted(ns for _, _, ns in marks["graph"]["marks"])
    expects = {role: [ns for name, _, ns in marks[role]["marks"] if name.startswith("expect_")] for role in marks}
    # Every traced request was received, launched and answered between its send and the next send,
    # and announced once: each arrived while no step was in flight (the first of them before the
    # marks window opened at its step).
    for i, (request, nxt) in enumerate(zip(traced, timeline[3:13])):
        window = [ns for ns in context if request["sent_ns"] <= ns < nxt["sent_ns"]]
        assert window, f"no context marks for request {request['request']}"
        assert any(request["sent_ns"] <= ns < nxt["sent_ns"] for ns in graph)
        for role in ("context", "graph") if i else ():
            announced = [ns for ns in expects[role] if request["sent_ns"] <= ns < nxt["sent_ns"]]
            assert len(announced) == 1, (role, request["request"], announced)
    for name in ("milestones.json", "milestones-spin.json"):  # the sleeping and the polling half
        milestones = json.loads((tmp_path / name).read_text())
        order = [row["milestone"] for row in milestones]
        # The graph generator takes the `Expect` while the context generator admits the request.
        assert [m for m in order if m != "graph.expect_received"] == FIRST_TOKEN_PATH, (name, order)
        assert (order.index("context.expect_send") < order.index("graph.expect_received")
                < order.index("graph.step_received")), (name, order)
        assert all(row["requests"] >= 3 for row in milestones), name
        first_chunk = milestones[-1]["median_ms"]
        assert 0 < milestones[0]["median_ms"] < first_chunk, name
    # Each half's gaps at the client and as the context generator sent the chunks: 2 per request.
    client_gaps = re.findall(r"^TTFT p50 .* over (\d+) gaps$", out.stdout, re.M)
    sent_gaps = re.findall(r"^chunks as sent: ITL p50 .* over (\d+) gaps$", out.stdout, re.M)
    assert client_gaps == ["10", "10"], out.stdout
    assert len(sent_gaps) == 2 and all(8 <= int(n) <= 10 for n in sent_gaps), out.stdout


@pytest.mark.parametrize("value", ["abc", "-3", "1.5"])
def test_a_bad_step_count_names_its_variable(monkeypatch, tmp_path, value):
    from hybridd.runtime.step_trace import StepTracer

    monkeypatch.setenv("HYBRIDD_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("HYBRIDD_TRACE_STEPS", value)
    with pytest.raises(ValueError, match=f"HYBRIDD_TRACE_STEPS must be a whole number of steps .*{value!r}"):
        StepTracer("context")


@pytest.mark.parametrize(("config", "message"), [("{busy", "not JSON"), ("[1]", "a JSON object of settings")])
def test_trace_requests_refuses_bad_settings_before_starting(tmp_path, config, message):
    out = subprocess.run([sys.executable, "-m", "scripts.trace_requests", "--out", str(tmp_path),
                          "--device", "cpu", "--config", config], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--config" in out.stderr and message in out.stderr, out.stderr
