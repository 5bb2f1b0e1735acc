"""`hybridd start --model ORG/NAME`: a Hugging Face hub id is served from the local hub
cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub; the snapshot that
refs/main names), and refused in one line that gives the download command when it is
not there (exit 2, before anything is spawned). The cache is one the test builds: the
embedded model saved in the hub's layout."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from hybridd import exit_codes
from hybridd.config import EMBEDDED_MODEL
from tests.daemon import HYBRIDD, clean_env

SHA = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str = "hybridd-test/tiny-shakespeare") -> Path:
    """A hub cache holding `repo` at refs/main; the snapshot's directory."""
    entry = root / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / SHA
    shutil.copytree(EMBEDDED_MODEL, snapshot)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(SHA)
    return snapshot


def _start(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([HYBRIDD, "start", *args], capture_output=True, text=True, timeout=60,
                          env=clean_env() | env)


def test_a_hub_id_in_the_cache_resolves_to_its_snapshot(tmp_path):
    snapshot = hub_cache(tmp_path / "hub")
    done = _start("--model", "hybridd-test/tiny-shakespeare", "--print-config",
                  env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    assert config["model"] == str(snapshot)
    assert config["served_model_name"] == ["hybridd-test/tiny-shakespeare"]  # the gateway's name for it
    # HF_HOME's hub directory when HF_HUB_CACHE is unset.
    done = _start("--model", "hybridd-test/tiny-shakespeare", "--print-config", env={"HF_HOME": str(tmp_path)})
    assert json.loads(done.stdout)["model"] == str(snapshot)


def test_a_hub_id_not_in_the_cache_is_refused_with_the_download_command(tmp_path):
    hub_cache(tmp_path / "hub")
    done = _start("--model", "hybridd-test/not-downloaded", "--runtime-dir", str(tmp_path / "run"),
                  env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert done.returncode == exit_codes.USAGE
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "hf download hybridd-test/not-downloaded" in lines[0], done.stderr
    assert str(tmp_path / "hub") in lines[0]
