"""The `hybridd` command: start, stop, status, generate, keygen, bench.

`start` runs the supervisor in the foreground (what systemd runs); the other commands
talk to a running daemon through the client SDK or its pid file, but `bench`, which
hands its arguments to the benchmark (hybridd/bench/, imported only when it runs). Command output goes
to stdout, one-line errors to stderr, logs (structlog) to stderr.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from hybridd import environment, exit_codes, hub_cache
from hybridd.config import (
    SECTIONS,
    Config,
    ConfigError,
    config_to_json,
    declarations,
    describe_allowed,
    describe_default,
    kind_of,
    load_config,
)

EXIT_ERROR = exit_codes.ERROR
EXIT_USAGE = exit_codes.USAGE
EXIT_ALREADY_RUNNING = exit_codes.ALREADY_RUNNING
EXIT_NOT_RUNNING = exit_codes.NOT_RUNNING
EXIT_REFUSED = exit_codes.REFUSED
EXIT_UNAVAILABLE = exit_codes.UNAVAILABLE
EXIT_INTERRUPTED = exit_codes.INTERRUPTED
STATUS_TIMEOUT_S = 2.0
STOP_POLL_S = 0.05
# `hybridd stop` waits this long beyond the configured drain timeout.
STOP_GRACE_S = 20.0


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(message, err=True)
    sys.exit(code)


# ---------------------------------------------------------------- configuration


class _SettingOption(click.Option):
    """A setting's flag; its help is the setting's declaration (hybridd/config.py)."""

    def __init__(self, *args: Any, section: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


_METAVARS = {"int": "INTEGER", "float": "NUMBER", "str": "TEXT", "list[int]": "N,N,...", "list[str]": "NAME,..."}


def _setting_help(f: dataclasses.Field) -> tuple[str, str]:
    """The flag's help text and metavar, from the setting's declaration."""
    declared = f.metadata["setting"]
    allowed = describe_allowed(f)
    if declared.choices:
        metavar = "[" + "|".join(declared.choices) + "]"
    elif declared.unit == "s":
        metavar = "SECONDS"
    elif declared.allowed in ("a file", "a directory"):
        metavar = "PATH"
    elif declared.allowed.startswith("HOST:PORT"):
        metavar = "HOST:PORT"
    elif declared.allowed and " " not in declared.allowed:
        metavar = declared.allowed
    else:
        metavar = _METAVARS.get(str(f.type), "VALUE")
    facts = [f"default: {describe_default(f)}"]
    if declared.unit:
        facts.append(f"unit: {declared.unit}")
    # Where the metavar or the flag pair already says what is allowed, the help does not repeat it.
    if not (declared.choices or kind_of(f) == "true or false" or allowed in (metavar, "a file", "a directory")):
        facts.append(f"allowed: {allowed}")
    return f"{declared.meaning}  [{'; '.join(facts)}]", metavar


def _config_field_options(function):
    """One `--field-name` flag per Config field: the CLI layer of the configuration."""
    for f, declared in reversed(declarations()):
        flag = "--" + f.name.replace("_", "-")
        text, metavar = _setting_help(f)
        if f.type in (bool, "bool"):
            function = click.option(f"{flag}/--no-{flag[2:]}", f.name, cls=_SettingOption, section=declared.section,
                                    default=None, help=text)(function)
        else:
            function = click.option(flag, f.name, cls=_SettingOption, section=declared.section, default=None,
                                    metavar=metavar, help=text)(function)
    return function


class _StartCommand(click.Command):
    """`hybridd start`: its settings' flags in the sections of the declaration."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {"": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(getattr(param, "section", ""), []).append(record)
        for section, records in groups.items():
            title, intro = SECTIONS[section] if section else ("Options", "")
            with formatter.section(f"{title} settings" if section else title):
                if intro:
                    formatter.write_text(intro)
                formatter.write_dl(records)


def resolve_config(path: str | None, overrides: dict[str, Any], environ: dict[str, str] | None = None) -> Config:
    """TOML file < HYBRIDD_* environment < flags; an error names the setting and the layer it came from."""
    environ = environment.snapshot() if environ is None else dict(environ)
    path = path or environ.get("HYBRIDD_CONFIG") or None
    overrides = {k: v for k, v in overrides.items() if v is not None}
    file_only = {"HYBRIDD_CONFIG": path} if path else {}
    layers = [
        (f"config file {path}" if path else "defaults", file_only, {}),
        ("environment (HYBRIDD_*)", environ, {}),
        ("command line", environ, overrides),
    ]
    config: Config | None = None
    for source, env, flags in layers:
        try:
            config = load_config(path, flags, environ=env)
        except ConfigError as error:
            message = str(error)
            if path and message.startswith(str(path)):
                raise
            for generic in ("config: ", "environment: "):  # load_config's own, vaguer source names
                message = message.removeprefix(generic)
            raise ConfigError(f"{_culprit(message, source, env, flags)}: {message}") from None
    assert config is not None
    return config


def _culprit(message: str, source: str, environ: dict[str, str], flags: dict[str, Any]) -> str:
    """The precise source of a bad setting: the variable or flag that set the field the message names."""
    for f in dataclasses.fields(Config):
        if not re.search(rf"\b{f.name}\b", message):
            continue
        if source == "command line" and f.name in flags:
            return f"command-line flag --{f.name.replace('_', '-')}"
        if source.startswith("environment") and f"HYBRIDD_{f.name.upper()}" in environ:
            return f"environment variable HYBRIDD_{f.name.upper()}"
    return source


def _load(config_path: str | None, overrides: dict[str, Any]) -> Config:
    try:
        return resolve_config(config_path, overrides)
    except ConfigError as error:
        _fail(f"hybridd: invalid configuration: {error}", EXIT_USAGE)
        raise AssertionError("unreachable")


def _with_model_resolved(config: Config) -> Config:
    """A hub id (ORG/NAME) as its snapshot's directory in the local Hugging Face cache; the
    gateway then serves it under the hub id (unless served_model_name names it)."""
    try:
        directory = hub_cache.resolve(config.model)
        if directory == config.model:
            return config
        return dataclasses.replace(config, model=directory,
                                   served_model_name=config.served_model_name or [config.model])
    except hub_cache.HubModelMissing as error:
        _fail(f"hybridd: cannot start: {error}", EXIT_USAGE)
        raise AssertionError("unreachable") from None


_config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                              envvar="HYBRIDD_CONFIG", show_envvar=True, help="TOML configuration file.")
_runtime_dir_option = click.option("--runtime-dir", default=None, help="The daemon's runtime directory.")
_endpoint_option = click.option("--endpoint", default=None,
                                help="Daemon endpoint (ipc://… or tcp://…); default: from the configuration.")
_server_key_option = click.option("--server-key", type=click.Path(exists=True, dir_okay=False), default=None,
                                  help="TCP: the daemon's public key file (from `hybridd keygen`).")
_client_key_option = click.option("--client-key", type=click.Path(exists=True, dir_okay=False), default=None,
                                  help="TCP: this client's secret key file (from `hybridd keygen`).")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="hybridd")
def main() -> None:
    """hybridd: a low-latency LLM inference daemon."""


# ---------------------------------------------------------------- start / stop


@main.command(cls=_StartCommand)
@_config_option
@click.option("--print-config", is_flag=True, help="Print the resolved configuration as JSON and exit.")
@_config_field_options
def start(config_path: str | None, print_config: bool, **overrides: Any) -> None:
    """Run the daemon in the foreground (what systemd's hybridd.service runs).

    Each setting below comes from the --config file, then its HYBRIDD_<NAME> environment
    variable, then its flag, each overriding the one before; the README's "Settings"
    section lists them with the environment variables that are not settings.
    """
    config = _with_model_resolved(_load(config_path, overrides))
    if print_config:
        click.echo(config_to_json(config))
        return
    from hybridd.preflight import PreflightError, check

    try:
        check(config)
    except PreflightError as error:
        _fail(f"hybridd: cannot start: {error}", EXIT_USAGE)
    from hybridd.cuda_mps import MpsError
    from hybridd.supervisor import AlreadyRunningError, run_supervisor

    try:
        code = run_supervisor(config, reload=lambda: _with_model_resolved(resolve_config(config_path, overrides)))
    except AlreadyRunningError as error:
        _fail(f"hybridd: {error}", EXIT_ALREADY_RUNNING)
    except (OSError, ValueError, MpsError) as error:
        _fail(f"hybridd: cannot start: {error}")
    sys.exit(code)


@main.command()
@_config_option
@_runtime_dir_option
@click.option("--timeout", type=float, default=None,
              help=f"Seconds to wait for the drain (default: drain_timeout_s + {STOP_GRACE_S:g}).")
def stop(config_path: str | None, runtime_dir: str | None, timeout: float | None) -> None:
    """Ask the running daemon to drain (SIGTERM) and wait until it has exited."""
    from hybridd.supervisor import running_pid

    config = _load(config_path, {"runtime_dir": runtime_dir})
    pid = running_pid(config.runtime_dir)
    if pid is None:
        _fail(f"hybridd is not running (no live supervisor in {config.runtime_dir})", EXIT_NOT_RUNNING)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        _fail(f"hybridd is not running (pid {pid} is gone)", EXIT_NOT_RUNNING)
    except PermissionError:
        _fail(f"hybridd: not allowed to signal pid {pid} (run as the daemon's user or root)")
    wait_s = config.drain_timeout_s + STOP_GRACE_S if timeout is None else timeout
    deadline = time.monotonic() + wait_s
    while running_pid(config.runtime_dir) == pid:
        if time.monotonic() > deadline:
            _fail(f"hybridd (pid {pid}) is still draining after {wait_s:g} s")
        time.sleep(STOP_POLL_S)
    click.echo(f"hybridd (pid {pid}) stopped")


# ---------------------------------------------------------------- client commands


def _client(config_path: str | None, runtime_dir: str | None, endpoint: str | None, server_key: str | None,
            client_key: str | None, timeout: float | None, connect_timeout: float | None,
            reply_ring: bool | str = "auto"):
    from hybridd.client import Client, load_curve_keys

    config = _load(config_path, {"runtime_dir": runtime_dir})
    endpoint = endpoint or config.client_endpoint
    keys: dict[str, bytes | None] = {}
    if endpoint.startswith("tcp://"):
        if not (server_key and client_key):
            _fail("hybridd: a tcp:// endpoint needs --server-key and --client-key (CURVE)", EXIT_USAGE)
        server_public, _ = load_curve_keys(server_key)
        public, secret = load_curve_keys(client_key)
        if secret is None:
            _fail(f"hybridd: {client_key} holds no secret key (use the .key_secret file)", EXIT_USAGE)
        keys = {"server_public_key": server_public, "public_key": public, "secret_key": secret}
    if connect_timeout is not None:
        keys["connect_timeout"] = connect_timeout
    return Client(endpoint, timeout=timeout, reply_ring=reply_ring, **keys), endpoint


def _failure(error: Exception, what: str) -> tuple[str, str, int]:
    """A client command's failure: the state it shows, its one line and its exit code
    (see README, Troubleshooting)."""
    from hybridd.errors import (
        DaemonUnreachableError,
        DrainingError,
        HandshakeRefusedError,
        RequestTimeoutError,
        UnavailableError,
    )

    if isinstance(error, HandshakeRefusedError):
        return "refused", f"hybridd: {error.message}", EXIT_REFUSED
    if isinstance(error, DaemonUnreachableError):
        return "not running", f"hybridd is not running: {error.message}", EXIT_NOT_RUNNING
    if isinstance(error, UnavailableError | DrainingError):
        return "unavailable", f"hybridd: {what}: {error}", EXIT_UNAVAILABLE
    if isinstance(error, RequestTimeoutError) and what == "status":
        return "unavailable", f"hybridd: status: {error.message}", EXIT_UNAVAILABLE
    return "error", f"hybridd: {error}" if what == "generate" else f"hybridd: {what} failed: {error}", EXIT_ERROR


def _fail_for(error: Exception, what: str) -> None:
    """One line and the exit code for a client command that failed."""
    _, message, code = _failure(error, what)
    _fail(message, code)


def _ms(seconds: Any) -> str:
    return "-" if not isinstance(seconds, int | float) else f"{seconds * 1000:.1f} ms"


def _bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours}h {minutes:02d}m {secs:02d}s" if hours or days else f"{minutes}m {secs:02d}s"
    return f"{days}d {text}" if days else text


def format_status(status: dict[str, Any]) -> str:
    """The human-readable `hybridd status`; tolerant of missing keys (the map may grow or shrink)."""
    get = status.get
    lines = [f"hybridd {get('state', '?')} — up {_duration(get('uptime_s'))}"
             + (f" (since {datetime.datetime.fromtimestamp(get('started_at')).isoformat(timespec='seconds')})"
                if isinstance(get("started_at"), int | float) else "")
             + (f", version {get('version')}" if get("version") else "")]
    if get("summary"):
        lines.append(f"state      {get('summary')}")
    for name, phase in (get("phases") or {}).items():
        progress = f" {phase.get('done')}/{phase.get('total')}" if phase.get("total") else ""
        elapsed = f" ({phase['elapsed_s']:.1f} s)" if isinstance(phase.get("elapsed_s"), int | float) else ""
        lines.append(f"{name:<10} {phase.get('phase', '-')}: {phase.get('detail') or '-'}{progress}{elapsed}")
    model = f"model      {get('model', '-')}  dtype {get('dtype', '-')}  device {get('device', '-')}"
    model += f"  kv {get('kv_cache_dtype')}" if get("kv_cache_dtype") not in (None, get("dtype")) else ""
    model += f"  max_model_len {get('max_model_len')}" if get("max_model_len") else ""
    lines.append(model + (f"  quantization {get('quantization').get('method', '?')}"
                          if isinstance(get("quantization"), dict) else ""))
    endpoints = get("endpoints") or {}
    if endpoints:
        lines.append("endpoints  " + ", ".join(str(e) for e in endpoints.values() if e))
    workers = get("workers") or {}
    lines.append("workers    " + ", ".join(
        f"{name} pid {w.get('pid', '-')} (restarts {w.get('restarts', '-')})" for name, w in workers.items()))
    if get("cuda_mps"):
        lines.append(f"CUDA MPS   {get('cuda_mps')}")
    if get("last_restart_reason"):
        lines.append(f"restarted  {get('last_restart_reason')}")
    if get("source") == "supervisor":
        return "\n".join(lines)
    requests = get("requests") or {}
    lines.append(f"requests   running {requests.get('running', '-')}, queued {requests.get('queued', '-')}, "
                 f"served {requests.get('served', '-')}, failed {requests.get('failed', '-')}")
    latency = get("latency") or {}
    lines.append(f"latency    TTFT p50 {_ms(latency.get('ttft_p50_s'))}, p99 {_ms(latency.get('ttft_p99_s'))}; "
                 f"ITL p50 {_ms(latency.get('itl_p50_s'))}, p99 {_ms(latency.get('itl_p99_s'))} "
                 f"({latency.get('window', '-')} inter-token samples)")
    if isinstance(get("tokens_per_s"), int | float):
        lines.append(f"throughput {get('tokens_per_s'):.1f} tokens/s over the last minute")
    rings = get("reply_rings") or {}
    if rings.get("attached") or rings.get("written"):
        lines.append(f"rings      {rings.get('attached', '-')} reply rings attached; {rings.get('written', '-')} "
                     f"replies written to rings, {rings.get('left_out', '-')} left to the socket (no room); "
                     f"sleeping readers woken {rings.get('wakes', '-')} times")
    kv = get("kv_blocks") or {}
    usage = f" ({get('kv_usage') * 100:.0f}% in use)" if isinstance(get("kv_usage"), int | float) else ""
    lines.append(f"KV blocks  {kv.get('used', '-')} used, {kv.get('free', '-')} free of {kv.get('total', '-')}{usage}")
    lines.append(f"graphs     {_bytes(get('graph_bytes'))} captured, pool {_bytes(get('graph_pool_bytes'))}, "
                 f"budget {_bytes(get('graph_memory_budget_bytes'))}")
    buckets = get("buckets") or []
    for kind, heading in (("decode", "decode buckets"), ("prefill", "prefill buckets"),
                          ("mixed", "mixed buckets (prompt chunks beside running streams)")):
        rows = [b for b in buckets if b.get("kind") == kind]
        if not rows:
            continue
        lines.append(heading)
        lines.append(f"  {'size':>6}  {'state':<9} {'bytes':>10} {'capture':>9} {'replays':>9} {'eager':>7} "
                     f"{'demand':>7} {'evicted':>7}")
        for b in sorted(rows, key=lambda b: b.get("size", 0)):
            state = "disabled" if b.get("disabled") else ("captured" if b.get("captured") else "pending")
            capture = f"{b['capture_s'] * 1000:.0f} ms" if isinstance(b.get("capture_s"), int | float) else "-"
            lines.append(f"  {b.get('size', '-'):>6}  {state:<9} {_bytes(b.get('bytes')):>10} {capture:>9} "
                         f"{b.get('replays', '-'):>9} {b.get('eager_runs', '-'):>7} {b.get('demand', '-'):>7} "
                         f"{b.get('evictions', '-'):>7}")
    return "\n".join(lines)


@main.command()
@_config_option
@_runtime_dir_option
@_endpoint_option
@_server_key_option
@_client_key_option
@click.option("--json", "as_json", is_flag=True, help="Print the status map as JSON.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=STATUS_TIMEOUT_S, show_default=True,
              help="Seconds to wait for the daemon and its answer.")
def status(config_path, runtime_dir, endpoint, server_key, client_key, as_json: bool, timeout: float) -> None:
    """Show the running daemon's state, workers, buckets, KV blocks, queues and latency."""
    from hybridd.errors import HybriddError

    # One answer, no stream: a reply ring would only be attached to be detached.
    client, endpoint = _client(config_path, runtime_dir, endpoint, server_key, client_key, timeout, timeout,
                               reply_ring=False)
    with client:
        try:
            result = client.status()
        except HybriddError as error:
            if not as_json:
                _fail_for(error, "status")
            # --json always prints JSON: what a script reads, the line on stderr for a person.
            state, message, code = _failure(error, "status")
            click.echo(json.dumps({"state": state, "endpoint": endpoint, "error": message, "exit_code": code},
                                  indent=2, sort_keys=True))
            _fail(message, code)
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else format_status(result))


@main.command()
@click.argument("prompt")
@_config_option
@_runtime_dir_option
@_endpoint_option
@_server_key_option
@_client_key_option
@click.option("--max-tokens", type=int, default=None, help="Most tokens to generate.")
@click.option("--temperature", type=float, default=None, help="0 = greedy.")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--repetition-penalty", type=float, default=None)
@click.option("--stop", "stop_strings", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, default=None, help="Do not stop at the model's EOS.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds for the whole request.")
@click.option("--connect-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds to wait for the daemon to answer the connection (default: the SDK's, 10 s).")
@click.option("--wait", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Wait up to this long for a starting or restarting daemon to be ready (default: fail at once).")
@click.option("--json", "as_json", is_flag=True, help="Print the final message (text, usage, timings) as JSON.")
def generate(prompt: str, config_path, runtime_dir, endpoint, server_key, client_key, max_tokens, temperature, top_k,
             top_p, seed, repetition_penalty, stop_strings, ignore_eos, timeout, connect_timeout, wait,
             as_json: bool) -> None:
    """Generate a completion of PROMPT, streamed to the terminal."""
    from hybridd.errors import HybriddError

    sampling = {k: v for k, v in {
        "max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
        "repetition_penalty": repetition_penalty, "stop": list(stop_strings) or None, "ignore_eos": ignore_eos,
    }.items() if v is not None}
    client, endpoint = _client(config_path, runtime_dir, endpoint, server_key, client_key, timeout, connect_timeout)
    with client:
        stream = None
        try:
            if wait is not None:
                client.wait_ready(wait)
            if as_json:
                result = client.generate(prompt, **sampling)
                click.echo(json.dumps({
                    "id": result.id, "text": result.text, "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason, "usage": result.usage.to_wire(),
                    "timings": result.timings.to_wire()}, indent=2))
                return
            stream = client.stream(prompt, **sampling)
            for chunk in stream:
                click.echo(chunk.text, nl=False)
            click.echo()
        except KeyboardInterrupt:
            if stream is not None:
                stream.close()
                click.echo()  # the streamed text's line ends
            _fail("hybridd: interrupted", EXIT_INTERRUPTED)
        except HybriddError as error:
            click.echo(err=True) if stream is not None else None
            _fail_for(error, "generate")


@main.command()
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Where to write the key files.")
@click.option("--name", default="hybridd", show_default=True, help="Base name of the key files.")
def keygen(directory: str, name: str) -> None:
    """Make a CURVE key pair: NAME.key (public, share it) and NAME.key_secret (mode 0600).

    The daemon's pair goes to curve_secret_key_file; each client's public NAME.key goes into
    curve_client_keys_dir.
    """
    import zmq.auth

    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (target / f"{name}{suffix}").exists():
            _fail(f"hybridd: {target / (name + suffix)} exists; refusing to overwrite a key")
    old_umask = os.umask(0o077)  # the secret file never exists with looser permissions
    try:
        public_file, secret_file = zmq.auth.create_certificates(target, name)
    finally:
        os.umask(old_umask)
    os.chmod(public_file, 0o644)
    click.echo(f"public key: {public_file}\nsecret key: {secret_file}")


# The benchmark parses its own arguments (`--help` included): click passes them through untouched.
@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Benchmark hybridd against its peers and the hardware floor (`hybridd bench --help`)."""
    from hybridd.bench.cli import main as bench_main

    sys.exit(bench_main(list(args)))


if __name__ == "__main__":
    main()
