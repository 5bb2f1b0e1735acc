"""The daemon's configuration: one dataclass, loaded from a TOML file, then `HYBRIDD_*`
environment variables, then command-line flags (each overriding the one before).

Every field is validated here with an error that names it, so a bad setting stops
`hybridd start` before any worker is spawned.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridd.kernels import gemm_fusions
from hybridd.protocol.supervisor import LOG_FORMATS, LOG_LEVELS
from hybridd.runtime.buckets import DEFAULT_DECODE_BUCKETS, DEFAULT_PREFILL_BUCKETS

# One day: longer deadlines are typos, and a drain deadline must fit in a timer.
MAX_TIMEOUT_S = 86400.0
MAX_BUSY_POLL_S = 10.0  # polling longer than this is a core spent for nothing
MAX_STEP_WAKE_POLL_S = 1.0  # a request is admitted in well under a millisecond
MAX_HEARTBEAT_INTERVAL_S = 60.0
MAX_KERNEL_COMPILE_WORKERS = 64  # each imports torch and Triton: a few hundred MB of memory

if TYPE_CHECKING:
    import torch

EMBEDDED_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-shakespeare"
ENV_PREFIX = "HYBRIDD_"
_LOG_VARIABLES = {ENV_PREFIX + "LOG_LEVEL": "log_level", ENV_PREFIX + "LOG_FORMAT": "log_format"}
# Variables the workers read themselves, not settings: the tests' hooks and the step
# tracer's (hybridd/runtime/step_trace.py).
_NOT_SETTINGS = (ENV_PREFIX + "TEST_", ENV_PREFIX + "TRACE_")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field and source."""


def default_runtime_dir() -> str:
    # systemd's RuntimeDirectory= sets RUNTIME_DIRECTORY; a user's session has XDG_RUNTIME_DIR.
    if os.environ.get("RUNTIME_DIRECTORY"):
        return os.environ["RUNTIME_DIRECTORY"].split(":")[0]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return str(Path(os.environ["XDG_RUNTIME_DIR"]) / "hybridd")
    return f"/tmp/hybridd-{os.getuid()}"


@dataclass
class Config:
    # model
    model: str = str(EMBEDDED_MODEL)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    # endpoints
    runtime_dir: str = field(default_factory=default_runtime_dir)
    endpoint: str = ""  # default ipc://{runtime_dir}/hybridd.sock
    tcp_endpoint: str = ""  # e.g. tcp://0.0.0.0:7070; requires CURVE keys
    curve_secret_key_file: str = ""
    curve_client_keys_dir: str = ""  # public *.key files of the clients allowed in over TCP
    curve_allow_any: bool = False  # true: any client with a CURVE key pair is let in (no allow-list)
    # the OpenAI-compatible HTTP gateway and Prometheus metrics (hybridd/gateway/); off when empty
    http_endpoint: str = ""  # HOST:PORT, e.g. 127.0.0.1:8000
    http_api_key_file: str = ""  # one API key per line; empty: no key needed
    metrics_endpoint: str = ""  # HOST:PORT serving /metrics alone (the gateway serves it too)
    # KV cache and batching
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: sized from kv_cache_memory_fraction (CUDA) or 512 (CPU)
    kv_cache_memory_fraction: float = 0.5
    max_model_len: int = 0  # 0: the model's own limit
    max_batch: int = 32
    decode_buckets: list[int] = field(default_factory=lambda: list(DEFAULT_DECODE_BUCKETS))
    prefill_buckets: list[int] = field(default_factory=lambda: list(DEFAULT_PREFILL_BUCKETS))
    max_prefill_tokens: int = 2048
    max_prefill_seqs: int = 8
    max_queued_requests: int = 256
    # static domain
    use_cuda_graphs: bool = True
    graph_memory_budget_mb: int = 1024
    # Processes that compile the graphs' Triton kernels at start, all at once, before the
    # captures load them (hybridd/runtime/kernel_precompile.py); 0: each kernel compiles at
    # its first launch, one after another. At most the host's core count are started.
    kernel_compile_workers: int = 8
    # on CUDA, sample with the fused Triton kernels (compiled at start) instead of eager torch
    compile_sampler: bool = True
    # auto/on: the workers share a CUDA device through a private MPS daemon; auto runs
    # without it where it is not installed or does not start (hybridd/cuda_mps.py)
    cuda_mps: str = "auto"
    # What the decode projections compute in their own kernel: norm, rotary, silu, mlp or none
    # (hybridd/kernels/gemm_fusions.py).
    gemm_fusions: str = gemm_fusions.DEFAULT
    # Chain the fused Triton kernels by programmatic dependent launch on compute
    # capability 9+ (hybridd/kernels/pdl.py)
    pdl: bool = True
    # After its last piece of work a worker polls its sockets this long without sleeping,
    # so that the next message is taken without a wake-up (0: sleep at once). Each worker
    # keeps a CPU core busy while it polls.
    busy_poll_s: float = 0.0
    # When a request arrives while no step is in flight, the graph generator is told a step
    # is coming (`control.Expect`) and polls its socket until it comes, for at most this
    # long, so that the step is not held up by the wake-up of the graph generator's threads
    # (0: it sleeps until the step wakes it).
    step_wake_poll_s: float = 0.005
    # Client sessions that may have a reply ring attached at once (each maps that client's
    # memory; ipc/reply_ring.py); 0 refuses every ring.
    max_reply_rings: int = 256
    # lifecycle: every deadline the supervisor applies is one of these
    startup_timeout_s: float = 900.0  # spawn to ready, per worker: loading, compiling, capturing
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 10.0  # a serving loop silent this long is hung
    drain_timeout_s: float = 30.0
    max_restarts: int = 5
    restart_backoff_s: float = 1.0
    log_level: str = "info"
    log_format: str = "console"  # console or json

    @property
    def client_endpoint(self) -> str:
        return self.endpoint or f"ipc://{self.runtime_dir}/hybridd.sock"

    @property
    def supervisor_endpoint(self) -> str:
        return f"ipc://{self.runtime_dir}/supervisor.sock"

    def validate(self) -> Config:
        def positive(name: str) -> None:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value!r}")
        for name in ("block_size", "max_batch", "max_prefill_tokens", "max_prefill_seqs", "max_queued_requests",
                     "graph_memory_budget_mb", "drain_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s",
                     "startup_timeout_s"):
            positive(name)
        for name in ("num_kv_blocks", "max_model_len", "max_restarts", "restart_backoff_s", "busy_poll_s",
                     "step_wake_poll_s", "max_reply_rings", "kernel_compile_workers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name, limit in (("heartbeat_interval_s", MAX_HEARTBEAT_INTERVAL_S), ("drain_timeout_s", MAX_TIMEOUT_S),
                            ("heartbeat_timeout_s", MAX_TIMEOUT_S), ("startup_timeout_s", MAX_TIMEOUT_S),
                            ("restart_backoff_s", MAX_TIMEOUT_S), ("busy_poll_s", MAX_BUSY_POLL_S),
                            ("step_wake_poll_s", MAX_STEP_WAKE_POLL_S)):
            if getattr(self, name) > limit:
                raise ConfigError(f"{name} must be at most {limit:g} s, got {getattr(self, name)!r}")
        if self.kernel_compile_workers > MAX_KERNEL_COMPILE_WORKERS:
            raise ConfigError(f"kernel_compile_workers must be at most {MAX_KERNEL_COMPILE_WORKERS}, "
                              f"got {self.kernel_compile_workers!r}")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must be at least twice "
                              f"heartbeat_interval_s ({self.heartbeat_interval_s:g})")
        self.log_level = self.log_level.lower()
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if not 0 < self.kv_cache_memory_fraction < 1:
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("decode_buckets", "prefill_buckets"):
            buckets = getattr(self, name)
            if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in buckets):
                raise ConfigError(f"{name} must be a non-empty list of positive integers, got {buckets!r}")
        self.decode_buckets = sorted({b for b in self.decode_buckets if b <= self.max_batch} | {self.max_batch})
        if max(self.prefill_buckets) > self.max_prefill_tokens:
            raise ConfigError(
                f"prefill_buckets: largest bucket {max(self.prefill_buckets)} exceeds max_prefill_tokens "
                f"{self.max_prefill_tokens}"
            )
        try:
            gemm_fusions.parse(self.gemm_fusions)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.cuda_mps not in ("auto", "on", "off"):
            raise ConfigError(f"cuda_mps must be auto, on or off, got {self.cuda_mps!r}")
        if self.cuda_mps == "on" and self.device == "cpu":
            raise ConfigError("cuda_mps = on needs a CUDA device, but device is cpu")
        if self.tcp_endpoint and not self.curve_secret_key_file:
            raise ConfigError("tcp_endpoint requires curve_secret_key_file (TCP is served only with CURVE)")
        if self.tcp_endpoint and not self.curve_client_keys_dir and not self.curve_allow_any:
            raise ConfigError("tcp_endpoint requires curve_client_keys_dir (the public keys of the clients allowed "
                              "in), or curve_allow_any = true to let in any client that has a CURVE key pair")
        if self.curve_allow_any and self.curve_client_keys_dir:
            raise ConfigError("curve_allow_any = true contradicts curve_client_keys_dir (an allow-list); set one")
        addresses = {}
        for name in ("http_endpoint", "metrics_endpoint"):
            if getattr(self, name):
                addresses[name] = parse_host_port(getattr(self, name), name)
        if len(addresses) == 2 and addresses["http_endpoint"] == addresses["metrics_endpoint"]:
            raise ConfigError("metrics_endpoint must differ from http_endpoint (the gateway serves /metrics too)")
        if self.http_api_key_file and not self.http_endpoint:
            raise ConfigError("http_api_key_file is set but http_endpoint is not")
        if self.endpoint and not self.endpoint.startswith("ipc://"):
            raise ConfigError(f"endpoint must be an ipc:// endpoint (use tcp_endpoint for TCP), got {self.endpoint!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def serves_http(self) -> bool:
        """Whether the gateway process runs (for the API, the metrics endpoint or both)."""
        return bool(self.http_endpoint or self.metrics_endpoint)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> Config:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown setting(s) {', '.join(unknown)}")
        config = cls()
        for name, value in values.items():
            setattr(config, name, _coerce(name, known[name], value, source))
        return config.validate()


def parse_host_port(value: str, name: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPV6]:PORT` or `:PORT` (loopback) → (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} must be HOST:PORT with a port in 1..65535, got {value!r}")
    host = host.removeprefix("[").removesuffix("]") or "127.0.0.1"
    if any(c.isspace() or c in "/[]" for c in host):
        raise ConfigError(f"{name}: invalid host {host!r} in {value!r}")
    return host, int(port)


def _field_type(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def _coerce(name: str, f: dataclasses.Field, value: Any, source: str) -> Any:
    kind = _field_type(f)
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.lower() in ("1", "true", "yes", "on")
            raise ValueError(value)
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "list[int]":
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return [int(v) for v in value]
        if kind == "str":
            if not isinstance(value, str):
                raise ValueError(value)
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: setting {name!r} expects {kind}, got {value!r}") from None
    return value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> Config:
    """TOML file < HYBRIDD_* environment < explicit overrides (CLI flags)."""
    values: dict[str, Any] = {}
    environ = os.environ if environ is None else environ
    path = path or environ.get(ENV_PREFIX + "CONFIG")
    if path:
        path = Path(path)
        try:
            values.update(tomllib.loads(path.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        Config.from_dict(values, source=str(path))  # names the file in errors
    names = {f.name for f in dataclasses.fields(Config)}
    for key, value in environ.items():
        if (key.startswith(ENV_PREFIX) and key != ENV_PREFIX + "CONFIG" and key not in _LOG_VARIABLES
                and not key.startswith(_NOT_SETTINGS)):
            name = key[len(ENV_PREFIX):].lower()
            if name not in names:
                raise ConfigError(f"environment: unknown setting {key}")
            values[name] = value
    for key, name in _LOG_VARIABLES.items():  # also read by hybridd.log before any config; empty means unset
        if environ.get(key):
            values[name] = environ[key]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return Config.from_dict(values, source="config")


def config_to_json(config: Config) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)


# The device and dtype are resolved in the workers: torch is the daemon's dependency, and
# the client imports this module (for the default endpoint) without it.
def resolve_device(config: Config) -> torch.device:
    """The configured device, with an explicit index for CUDA (`set_device` needs one)."""
    import torch

    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    """The configured dtype; `auto` is bfloat16 on CUDA and float32 elsewhere."""
    import torch

    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)
