"""The steps' counters against the two real worker processes: a prompt longer than
`max_prefill_tokens` runs in chunks, which status's `steps` counts, and /metrics renders
each count as its counter family."""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridd.metrics import render
from tests.engine_pair import EnginePair
from tests.host_load import on_this_host

pytestmark = pytest.mark.slow
CHUNK = 32  # max_prefill_tokens


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with EnginePair(tmp_path_factory.mktemp("run"), device="cpu", dtype="float32", max_prefill_tokens=CHUNK,
                    prefill_buckets=[16, CHUNK]) as engine:
        yield engine


def test_chunked_steps_reach_status_and_metrics(pair):
    client = pair.client(version=3)
    try:
        prompt = [random.randrange(4, 60) for _ in range(3 * CHUNK + 5)]
        final, _ = client.generate(timeout=on_this_host(60), prompt_token_ids=prompt, stream=False,
                                   sampling={"max_tokens": 2})
        assert final["type"] == "final", final
        status = client.request({"type": "status"}, timeout=on_this_host(30))["status"]
    finally:
        client.close()
    counted = status["steps"]
    assert counted["chunked_prefill"] >= 4  # the prompt's four chunks
    assert counted["total"] >= counted["prefill"] >= counted["chunked_prefill"]
    assert counted["tokens"] >= len(prompt) + 1
    assert counted["tokens_per_step"] == pytest.approx(counted["tokens"] / counted["total"])
    samples = {s.name: s.value for family in text_string_to_metric_families(render(status, "m").decode())
               for s in family.samples}
    assert samples["hybridd:steps_total"] == counted["total"]
    assert samples["hybridd:step_tokens_total"] == counted["tokens"]
    assert samples["hybridd:prefill_steps_total"] == counted["prefill"]
    assert samples["hybridd:chunked_prefill_steps_total"] == counted["chunked_prefill"]
    assert samples["hybridd:mixed_steps_total"] == counted["mixed"]
