"""docs/performance_plot.py: the plot of docs/performance.md, drawn from the committed bench results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "performance_plot.py"
RUNS = ["bench_h100_llama2_7b.json", "bench_h100_llama3_8b.json", "bench_h200_paced.json", "bench_llama3_8b.json"]


def test_the_page_plot_is_drawn_from_the_committed_runs(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "performance.png"
    done = subprocess.run([sys.executable, str(PLOT), *(str(ROOT / "docs" / "lab" / run) for run in RUNS),
                           "--png", str(png)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize(("content", "says"), [(None, "cannot read it"), ("not json", "not JSON"),
                                               ("[1]", "expected a JSON object"),
                                               ('{"meta": {}}', "not a bench result of `hybridd bench`")])
def test_a_file_that_is_not_a_bench_result_is_refused_by_name(tmp_path, content, says):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    done = subprocess.run([sys.executable, str(PLOT), str(path), "--png", str(tmp_path / "out.png")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{path}: {says}" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out.png").exists()
