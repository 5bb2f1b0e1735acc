"""`hybridd status` as a person reads it: the supervisor's answer while the workers
cannot serve, and the context generator's when they do."""

from __future__ import annotations

from hybridd.cli import format_status


def test_status_from_the_supervisor_shows_the_phases_and_the_last_restart():
    text = format_status({
        "state": "degraded", "source": "supervisor", "version": "0.1.0", "uptime_s": 75.0,
        "summary": "degraded: restarting (1/5): graph: capturing decode graphs 3/7; context: loading tokenizer",
        "model": "/m", "endpoints": {"ipc": "ipc:///run/hybridd/hybridd.sock", "tcp": None},
        "workers": {"graph": {"pid": 11, "restarts": 1}, "context": {"pid": 12, "restarts": 1}},
        "phases": {"graph": {"phase": "capturing", "detail": "capturing decode graphs", "done": 3, "total": 7,
                             "elapsed_s": 4.25},
                   "context": {"phase": "loading", "detail": "loading tokenizer", "done": 0, "total": 0,
                               "elapsed_s": 1.0}},
        "restarts": 1, "last_restart_reason": "context generator missed heartbeats for 10 s (hung)",
        "cuda_mps": "unavailable (nvidia-cuda-mps-control exited 1: no devices)",
    })
    lines = text.splitlines()
    assert lines[0] == "hybridd degraded — up 1m 15s, version 0.1.0"
    assert "graph      capturing: capturing decode graphs 3/7 (4.2 s)" in lines
    assert "context    loading: loading tokenizer (1.0 s)" in lines
    assert "endpoints  ipc:///run/hybridd/hybridd.sock" in lines
    assert "restarted  context generator missed heartbeats for 10 s (hung)" in lines
    assert "CUDA MPS   unavailable (nvidia-cuda-mps-control exited 1: no devices)" in lines
    assert not any(line.startswith(("requests", "latency", "KV blocks")) for line in lines)


def test_status_while_serving_names_what_the_latency_window_counts():
    text = format_status({
        "state": "ready", "version": "0.1.0", "max_model_len": 1024, "tokens_per_s": 812.5, "kv_usage": 0.25,
        "kv_blocks": {"total": 512, "used": 128, "free": 384}, "latency": {"window": 2048},
        "requests": {"running": 1, "queued": 0, "served": 9, "failed": 0},
        "reply_rings": {"attached": 2, "written": 40, "left_out": 3, "wakes": 12},
    })
    assert "(2048 inter-token samples)" in text
    assert ("rings      2 reply rings attached; 40 replies written to rings, 3 left to the socket (no room); "
            "sleeping readers woken 12 times") in text
    quiet = format_status({"state": "ready", "reply_rings": {"attached": 0, "written": 0, "left_out": 0}})
    assert "rings " not in quiet  # no line while no client has used a ring
    assert "throughput 812.5 tokens/s over the last minute" in text
    assert "KV blocks  128 used, 384 free of 512 (25% in use)" in text
    assert "max_model_len 1024" in text
