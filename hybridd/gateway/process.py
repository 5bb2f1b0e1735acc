"""The gateway process: uvicorn servers for the OpenAI-compatible API (`http_endpoint`)
and the metrics endpoint (`metrics_endpoint`), in one asyncio loop over one
`hybridd.AsyncClient` session with the daemon (with its reply ring where the daemon
attaches one, as the SDK's).

The supervisor spawns it like a worker (`hybridd.gateway.supervised`) and stops it
with SIGTERM, which closes the listening sockets and lets running responses finish
(the daemon has drained them by then); SIGINT belongs to the supervisor. HTTP
parsing happens here, never in a worker, so a bad request cannot take the engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine, Iterator
from typing import Any

import uvicorn

from hybridd.client import AsyncClient
from hybridd.config import Config, parse_host_port
from hybridd.fallback_endpoint import fallback_endpoint
from hybridd.gateway.api_keys import load_api_keys
from hybridd.gateway.app import Gateway, create_app, create_metrics_app
from hybridd.gateway.http_protocol import HeadWithBodyProtocol
from hybridd.log import configure, get_logger

log = get_logger("gateway")

# After SIGTERM: how long open connections get to finish before they are closed.
GRACEFUL_SHUTDOWN_S = 5.0


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the process (one handler for all servers)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _server(app: Any, address: str, name: str) -> _Server:
    host, port = parse_host_port(address, name)
    # httptools parses in C, and a response's head leaves with its first event in one
    # write (HeadWithBodyProtocol); no access log and no proxy-header rewriting on every
    # request's way (the gateway logs no client addresses). The event loop's TCP
    # transports already set TCP_NODELAY, so a small event is never held back by Nagle.
    return _Server(uvicorn.Config(
        app, host=host, port=port, http=HeadWithBodyProtocol, ws="none", log_config=None, access_log=False,
        proxy_headers=False, lifespan="off", server_header=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    ))


def build_gateway(config: Config, client: AsyncClient) -> Gateway:
    keys = load_api_keys(config.http_api_key_file) if config.http_api_key_file else None
    supervisor = fallback_endpoint(client.endpoint)
    # The supervisor answers health alone: no reply ring for it.
    fallback = AsyncClient(supervisor, reply_ring=False) if supervisor else None
    return Gateway(client, config.model, keys, fallback=fallback, salt_by_api_key=config.http_cache_salt_by_api_key,
                   served_names=config.served_model_name, strict_openai=config.strict_openai,
                   tool_call_parser=config.tool_call_parser)


async def serve(config: Config, *, endpoint: str | None = None,
                stop_signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
    """Serve until one of `stop_signals`; `endpoint` overrides the daemon's client endpoint."""
    client = AsyncClient(endpoint or config.client_endpoint)
    gateway = build_gateway(config, client)
    servers: list[_Server] = []
    if config.http_endpoint:
        servers.append(_server(create_app(gateway, config.http_cors_origins), config.http_endpoint, "http_endpoint"))
    if config.metrics_endpoint:
        servers.append(_server(create_metrics_app(gateway), config.metrics_endpoint, "metrics_endpoint"))
    if not servers:
        raise ValueError("the gateway needs http_endpoint or metrics_endpoint")

    def stop() -> None:
        log.info("gateway stopping")
        for server in servers:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    for signum in stop_signals:
        loop.add_signal_handler(signum, stop)
    log.info("gateway serving", http_endpoint=config.http_endpoint or None,
             metrics_endpoint=config.metrics_endpoint or None, daemon=client.endpoint, api_keys=bool(gateway.api_keys),
             cache_salt_by_api_key=gateway.salt_by_api_key)
    try:
        await asyncio.gather(*(server.serve() for server in servers))
    finally:
        stop()
        await client.close()
        if gateway.fallback is not None:
            await gateway.fallback.close()


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run the gateway's loop: uvloop's when it is installed (as uvicorn would choose it),
    whose faster wake-ups and socket writes shorten the way of every first token."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def main(config: dict[str, Any], supervisor_endpoint: str) -> None:
    """The supervised entry point (see hybridd.supervisor.worker_main)."""
    cfg = Config.from_dict(config)
    configure(cfg.log_level)
    run(serve(cfg))


def run_standalone(argv: list[str] | None = None) -> None:
    """`python -m hybridd.gateway.process`: the gateway alone, in the foreground, against
    a running daemon (the benchmarks and tests use it; the daemon runs its own)."""
    import argparse

    from hybridd.config import load_config

    parser = argparse.ArgumentParser(description="hybridd's HTTP gateway, outside the supervisor")
    parser.add_argument("--endpoint", help="the daemon's endpoint (default: from the configuration)")
    for name in ("http_endpoint", "metrics_endpoint", "http_api_key_file", "model", "log_level"):
        parser.add_argument("--" + name.replace("_", "-"), dest=name)
    parser.add_argument("--http-cache-salt-by-api-key", dest="http_cache_salt_by_api_key", action="store_true",
                        default=None)
    for name in ("served_model_name", "http_cors_origins"):
        parser.add_argument("--" + name.replace("_", "-"), dest=name)
    parser.add_argument("--strict-openai", dest="strict_openai", action="store_true", default=None)
    args = vars(parser.parse_args(argv))
    endpoint = args.pop("endpoint")
    config = load_config(overrides=args)
    configure(config.log_level)
    run(serve(config, endpoint=endpoint, stop_signals=(signal.SIGTERM, signal.SIGINT)))


if __name__ == "__main__":
    run_standalone()
