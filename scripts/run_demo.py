"""The README's main job: start the daemon on the embedded default model, stream an
answer to a prompt through the client SDK, then stop the daemon (drain).

    python -m scripts.run_demo ["PROMPT"]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import hybridd
from hybridd.errors import HybriddError


def main() -> int:
    prompt = sys.argv[1] if len(sys.argv) > 1 else "ROMEO:"
    runtime_dir = tempfile.mkdtemp(prefix="hybridd-demo-")
    endpoint = f"ipc://{runtime_dir}/hybridd.sock"
    env = dict(os.environ, HYBRIDD_LOG_LEVEL=os.environ.get("HYBRIDD_LOG_LEVEL", "warning"))
    daemon = subprocess.Popen([sys.executable, "-m", "hybridd.cli", "start", "--runtime-dir", runtime_dir], env=env)
    try:
        with hybridd.Client(endpoint, timeout=5.0) as client:
            deadline = time.monotonic() + 300
            while True:
                if daemon.poll() is not None:
                    print(f"hybridd start exited with {daemon.returncode}", file=sys.stderr)
                    return 1
                try:
                    if client.health(timeout=1.0).ok:
                        break
                except HybriddError:
                    pass
                if time.monotonic() > deadline:
                    print("the daemon did not become ready in 300 s", file=sys.stderr)
                    return 1
            print(prompt, end="", flush=True)
            stream = client.stream(prompt, max_tokens=96, temperature=0.0, timeout=120.0)
            for chunk in stream:
                print(chunk.text, end="", flush=True)
            print()
            result = stream.result
            if result is not None:
                print(f"[{result.finish_reason}; {result.usage.completion_tokens} tokens]", file=sys.stderr)
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)  # drain, then exit
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
