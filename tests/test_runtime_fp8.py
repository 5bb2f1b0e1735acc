"""`hybridd start --quantization fp8` on the CPU: the daemon serves the embedded model with
FP8 weights token for token as the FP8 model decodes in-process, and says so: `status`
(and `hybridd status`), the start-up log and the gateway's `/v1/models` name the
quantization; status and the log name the KV cache's dtype (the model's, by default)."""

from __future__ import annotations

import httpx
import pytest
import torch

from hybridd.cli import format_status
from hybridd.client import Client
from hybridd.config import EMBEDDED_MODEL
from hybridd.engine.generate import greedy_generate
from hybridd.model import load_model, load_tokenizer
from tests.gateway_daemon import API_KEY, run_daemon_with_gateway

pytestmark = pytest.mark.slow


def test_fp8_daemon_serves_the_fp8_model_and_reports_its_quantization():
    model = load_model(EMBEDDED_MODEL, dtype=torch.float32, quantization="fp8")
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    expected = greedy_generate(model, [tokenizer.encode("ROMEO:")], 24)[0]
    plain = greedy_generate(load_model(EMBEDDED_MODEL, dtype=torch.float32), [tokenizer.encode("ROMEO:")], 24)[0]

    with run_daemon_with_gateway("--quantization", "fp8", "--dtype", "float32", "--log-level", "info") as daemon:
        with Client(daemon.endpoint) as client:
            status = client.status()
            result = client.generate("ROMEO:", max_tokens=24, temperature=0.0, ignore_eos=True)
        assert status["quantization"]["method"] == "fp8"
        assert status["quantization"]["source"] == "load"
        assert status["quantization"]["weights"] == "channel"
        assert "quantization fp8" in format_status(status)
        assert result.token_ids == expected, (result.token_ids, plain)

        models = httpx.get(daemon.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert models.status_code == 200, models.text
        assert [card["quantization"] for card in models.json()["data"]] == ["fp8"]
        log = daemon.log_path.read_text(errors="replace")
        assert "fp8 e4m3 weights" in log
        assert "kv_cache_dtype=float32" in log and status["kv_cache_dtype"] == "float32"  # the model's: auto
