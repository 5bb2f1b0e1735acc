"""docs/grafana-dashboard.json against the real daemon's /metrics: the file is a Grafana
dashboard, and every metric its panels query is one that /metrics serves — after a
few requests, with the histograms the issue asked for (prompt and generation tokens,
prefill and decode step time) and the process metrics among them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_daemon import API_KEY, run_daemon_with_gateway

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"
# A metric name in a PromQL expression: hybridd's families and the process metrics.
METRIC = re.compile(r"\b((?:hybridd:|process_)[a-zA-Z0-9_:]+)")
# What a family's samples add to its name in the exposition.
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def _queried_metrics(dashboard: dict) -> dict[str, set[str]]:
    queried: dict[str, set[str]] = {}
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = METRIC.findall(target["expr"])
            assert names, (panel["title"], target["expr"])
            queried.setdefault(panel["title"], set()).update(names)
    return queried


def test_the_dashboard_is_grafana_json_with_unique_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["panels"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"type", "title", "gridPos", "targets", "datasource"} <= panel.keys(), panel.get("title")


def test_every_panels_metric_is_served_by_metrics():
    queried = _queried_metrics(json.loads(DASHBOARD.read_text()))
    with run_daemon_with_gateway() as daemon:
        for prompt in ("ROMEO:", "JULIET: " * 20):
            response = httpx.post(daemon.url + "/v1/completions", timeout=120,
                                  headers={"Authorization": f"Bearer {API_KEY}"},
                                  json={"model": "tiny-shakespeare", "prompt": prompt, "max_tokens": 8})
            assert response.status_code == 200, response.text
        text = httpx.get(daemon.url + "/metrics", timeout=60).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {sample.name for family in families.values() for sample in family.samples}
    for title, names in queried.items():
        for name in names:
            assert name in samples or name.removesuffix("_total") in families, \
                f"panel {title!r} queries {name}, which /metrics does not serve"
    for name in ("prefill_step_seconds", "decode_step_seconds", "request_prompt_tokens", "request_generation_tokens"):
        family = families["hybridd:" + name]
        count = next(s.value for s in family.samples if s.name.endswith("_count"))
        assert count > 0, name
    workers = {s.labels["worker"] for s in families["hybridd:process_resident_memory_bytes"].samples}
    assert {"context", "graph", "gateway"} <= workers, workers
