"""The README's main job: start the daemon on the embedded default model, stream an
answer to a prompt through the client SDK, then stop the daemon (drain).

    python -m scripts.run_demo ["PROMPT"]
"""

from __future__ import annotations

import sys

import hybridd
from hybridd.bench.daemon import running


def main() -> int:
    prompt = sys.argv[1] if len(sys.argv) > 1 else "ROMEO:"
    try:
        with running() as daemon, hybridd.Client(daemon.endpoint, timeout=5.0) as client:
            print(prompt, end="", flush=True)
            stream = client.stream(prompt, max_tokens=96, temperature=0.0, timeout=120.0)
            for chunk in stream:
                print(chunk.text, end="", flush=True)
            print()
            if stream.result is not None:
                print(f"[{stream.result.finish_reason}; {stream.result.usage.completion_tokens} tokens]",
                      file=sys.stderr)
    except (RuntimeError, TimeoutError) as exc:  # the daemon did not start: its log's tail says why
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
