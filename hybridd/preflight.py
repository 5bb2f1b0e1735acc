"""Checks made before any worker is spawned: what no restart could fix.

The configuration's values are checked by `Config.validate`; here, what they point to:
the runtime directory (creatable, socket paths short enough), the model directory (it
exists, is a directory, `config.json` parses and names a supported architecture,
weights and a tokenizer are there), the CURVE key files (readable, a secret key where
one is needed) and the HTTP API key file (readable, not empty). Each error names the
path at fault;
`hybridd start` prints it on one line and exits with `exit_codes.USAGE` in well under a
second (nothing here imports torch). What only loading can find (a truncated weight
file, memory too small for the KV cache) is the workers' to report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridd.architectures import SUPPORTED_ARCHITECTURES
from hybridd.config import Config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHTS_INDEX = "model.safetensors.index.json"


class PreflightError(ValueError):
    """A model directory or key file that cannot be used; the message names the path."""


def check(config: Config) -> None:
    check_runtime_dir(config)
    check_model_dir(Path(config.model))
    if config.curve_secret_key_file:
        check_curve_secret_key(Path(config.curve_secret_key_file))
    if config.curve_client_keys_dir:
        check_client_keys_dir(Path(config.curve_client_keys_dir))
    if config.http_api_key_file:
        check_api_key_file(Path(config.http_api_key_file))


def check_runtime_dir(config: Config) -> None:
    from hybridd.ipc.channel import MAX_IPC_PATH_BYTES

    runtime_dir = Path(config.runtime_dir)
    # The longest worker control socket: ctl-<pid>-<generation>.sock.
    longest_control = f"ipc://{runtime_dir}/ctl-{2**22}-{10**6}.sock"
    for endpoint in (config.client_endpoint, config.supervisor_endpoint, longest_control):
        path = endpoint.removeprefix("ipc://")
        if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            raise PreflightError(f"socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow at most "
                                 f"{MAX_IPC_PATH_BYTES}: choose a shorter runtime_dir (or endpoint)")
    existing = runtime_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PreflightError(f"runtime_dir {runtime_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PreflightError(f"runtime_dir {runtime_dir}: {existing} is not writable by this user")


def check_model_dir(model: Path) -> None:
    if not model.exists():
        raise PreflightError(f"model {model}: no such directory")
    if not model.is_dir():
        raise PreflightError(f"model {model}: not a directory (expected a Hugging Face model directory)")
    if not os.access(model, os.R_OK | os.X_OK):
        raise PreflightError(f"model {model}: directory not readable")
    config_file = model / "config.json"
    if not config_file.is_file():
        raise PreflightError(f"{config_file}: missing (every model directory needs its config.json)")
    try:
        values = json.loads(config_file.read_bytes())
    except OSError as error:
        raise PreflightError(f"{config_file}: cannot read: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PreflightError(f"{config_file}: not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise PreflightError(f"{config_file}: expected a JSON object at the top level")
    architectures = values.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise PreflightError(f"{config_file}: field 'architectures' must list exactly one architecture, "
                             f"got {architectures!r}")
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise PreflightError(f"{config_file}: unsupported architecture {architectures[0]!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    index = model / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_bytes())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise PreflightError(f"{index}: not a valid safetensors index ({error})") from None
        missing = sorted(s for s in shards if not isinstance(s, str) or not (model / s).is_file())
        if missing:
            raise PreflightError(f"{index}: weight shard(s) missing: {', '.join(map(str, missing[:5]))}")
    elif not any(model.glob("*.safetensors")):
        raise PreflightError(f"model {model}: no weights (*.safetensors or {WEIGHTS_INDEX})")
    for weights in (model.glob("*.safetensors")):
        if not os.access(weights, os.R_OK):
            raise PreflightError(f"{weights}: not readable")
    if not any((model / name).is_file() for name in TOKENIZER_FILES):
        raise PreflightError(f"model {model}: no tokenizer ({', '.join(TOKENIZER_FILES)})")


def check_curve_secret_key(path: Path) -> None:
    import zmq.auth

    try:
        _, secret = zmq.auth.load_certificate(path)
    except OSError as error:
        raise PreflightError(f"curve_secret_key_file {path}: cannot read: {error.strerror or error}") from None
    except ValueError as error:
        raise PreflightError(f"curve_secret_key_file {path}: not a CURVE key file ({error})") from None
    if not secret:
        raise PreflightError(f"curve_secret_key_file {path}: holds no secret key (use the .key_secret file "
                             "from `hybridd keygen`)")


def check_api_key_file(path: Path) -> None:
    from hybridd.gateway.api_keys import load_api_keys

    try:
        load_api_keys(path)
    except OSError as error:
        raise PreflightError(f"http_api_key_file {path}: cannot read: {error.strerror or error}") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise PreflightError(str(error) if isinstance(error, ValueError) and str(error).startswith("http_api_key_file")
                             else f"http_api_key_file {path}: not a text file of keys ({error})") from None


def check_client_keys_dir(path: Path) -> None:
    if not path.is_dir():
        raise PreflightError(f"curve_client_keys_dir {path}: no such directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise PreflightError(f"curve_client_keys_dir {path}: not readable")
