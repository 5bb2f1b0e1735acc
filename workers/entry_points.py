"""The workers' entry points, as the supervisor spawns them.

The supervisor and the CLI import this module, so it stays light: each entry point
imports its worker (torch, the model, the engine) in the fresh process it runs in.
"""

from __future__ import annotations

from typing import Any


def graph_generator(config: dict[str, Any], ctl_endpoint: str) -> None:
    from hybridd.workers import graph_generator as worker

    worker.main(config, ctl_endpoint)


def context_generator(config: dict[str, Any], ctl_endpoint: str) -> None:
    from hybridd.workers import context_generator as worker

    worker.main(config, ctl_endpoint)
