"""The wheel as users install it: one top-level package, `hybridd`; a client-only install
(no extras, so neither torch nor transformers) that runs the SDK against a real daemon;
and no clash with PyPI's packages named `protocol`, `ipc` and `workers`.

The fresh virtual environment fetches the client's dependencies (and the three foreign
packages) from the package index, so these tests need the network; they are slow but
bounded, and run in CI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from tests.daemon import run_daemon

ROOT = Path(__file__).resolve().parent.parent
FOREIGN = ("protocol", "ipc", "workers")  # PyPI projects whose import names the repository's folders share
PIP_TIMEOUT_S = 600

pytestmark = pytest.mark.slow


def pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True, timeout=PIP_TIMEOUT_S)


def run_python(python: Path, code: str) -> dict:
    """Run `code` in the fresh environment (outside the checkout); it prints one JSON line."""
    done = subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the dev environment has setuptools, and fetching it again is slow.
    pip(Path(sys.executable), "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT))
    (built,) = out.glob("hybridd-*.whl")
    return built


@pytest.fixture(scope="module")
def client_python(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel and only its base (client) dependencies."""
    env = tmp_path_factory.mktemp("client-venv")
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    pip(python, "install", str(wheel))
    return python


def test_wheel_has_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"hybridd"}
    for package in ("ipc", "protocol", "workers"):
        assert f"hybridd/{package}/__init__.py" in names


def test_client_only_install_runs_the_sdk_against_a_daemon(client_python):
    with run_daemon() as daemon:
        seen = run_python(client_python, f"""
            import importlib.util, json, sys
            import hybridd
            with hybridd.Client({daemon.endpoint!r}) as client:
                health = client.health()
                result = client.generate("To be, or not", max_tokens=4, temperature=0)
            print(json.dumps({{
                "ok": health.ok, "finish_reason": result.finish_reason, "tokens": len(result.token_ids),
                "text": result.text, "server_packages": [n for n in ("torch", "transformers", "safetensors")
                                                         if importlib.util.find_spec(n) is not None],
                "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")),
                "hybridd": hybridd.__file__,
            }}))
        """)
    assert seen["server_packages"] == [] and seen["loaded"] == []
    assert seen["hybridd"].startswith(str(client_python.parent.parent))
    assert seen["ok"] is True
    assert seen["finish_reason"] == "length" and seen["tokens"] == 4 and isinstance(seen["text"], str)


def test_installs_next_to_pypi_protocol_ipc_and_workers(client_python):
    # Their own dependencies (numpy, lxml, ...) are beside the point: what matters is that
    # neither install overwrites the other's files and both sides import.
    pip(client_python, "install", "--no-deps", *FOREIGN)
    seen = run_python(client_python, """
        import base64, hashlib, importlib.metadata as md, importlib.util, json
        import hybridd, hybridd.client, hybridd.errors, hybridd.ipc, hybridd.protocol.errors, hybridd.workers
        import ipc  # PyPI's ipc: a plain module, importable on its own
        def intact(dist):
            broken = []
            for f in md.distribution(dist).files or []:
                if f.hash is None:
                    continue
                digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, f.read_binary()).digest()).rstrip(b"=")
                if digest.decode() != f.hash.value:
                    broken.append(str(f))
            return broken
        print(json.dumps({
            "origins": {n: importlib.util.find_spec(n).origin for n in ("protocol", "ipc", "workers")},
            "ipc": ipc.__file__,
            "ours": [m.__file__ for m in (hybridd.ipc, hybridd.protocol.errors, hybridd.workers)],
            "broken": {d: intact(d) for d in ("hybridd", "protocol", "ipc", "workers")},
        }))
    """)
    site = str(client_python.parent.parent)
    for name, origin in seen["origins"].items():
        assert origin.startswith(site) and "/hybridd/" not in origin, (name, origin)
    assert all("/site-packages/hybridd/" in path for path in seen["ours"])
    assert seen["broken"] == {"hybridd": [], "protocol": [], "ipc": [], "workers": []}
