"""Checks made before any worker is spawned: what no restart could fix.

The configuration's values are checked by `Config.validate`; here, what they point to:
the runtime directory (creatable, socket paths short enough), the model directory (it
exists, is a directory, `config.json` parses and names a supported architecture and
no quantization but FP8's,
weights and a tokenizer are there), FP8 (weights or KV cache) on a GPU without FP8, the CURVE key files (readable, a secret key where
one is needed) and the HTTP API key file (readable, not empty); a CUDA device that is
not there (no usable GPU, an index out of range); settings that cannot serve together
(a KV cache that cannot hold one max_model_len sequence, a max_batch its KV blocks can
never run); a draft model (speculative_drafter draft_model) that is no model directory or
has another vocabulary or tokenizer than the model's; an EAGLE-3 head (speculative_drafter
eagle3) whose config or tensors do not fit the model (`hybridd.eagle3_head`). Each error names the path or setting
at fault; `hybridd start` prints it on one line and exits with `exit_codes.USAGE` in well under a second (nothing here imports
torch, but for a configured CUDA device). What only loading can find (a truncated
weight file, memory too small for the KV cache) is the workers' to report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridd import quantization
from hybridd.architectures import SUPPORTED_ARCHITECTURES
from hybridd.config import Config, draft_model_dir, eagle3_head_dir
from hybridd.eagle3_head import Eagle3HeadError, read_head

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHTS_INDEX = "model.safetensors.index.json"


class PreflightError(ValueError):
    """A model directory or key file that cannot be used; the message names the path."""


def check(config: Config) -> None:
    check_runtime_dir(config)
    model_config = check_model_dir(Path(config.model))
    check_kv_cache(config, model_config)
    if config.speculative_drafter == "draft_model":
        check_draft_model(Path(draft_model_dir(config)), Path(config.model), model_config)
    if config.speculative_drafter == "eagle3":
        check_eagle3_head(Path(eagle3_head_dir(config)), model_config)
    if config.curve_secret_key_file:
        check_curve_secret_key(Path(config.curve_secret_key_file))
    if config.curve_client_keys_dir:
        check_client_keys_dir(Path(config.curve_client_keys_dir))
    if config.http_api_key_file:
        check_api_key_file(Path(config.http_api_key_file))
    check_device(config.device)
    check_fp8_device(config, model_config)


def check_device(device: str) -> None:
    """A configured CUDA device must be there: without this, the workers would crash and
    be restarted until max_restarts ran out."""
    if not device.startswith("cuda"):
        return  # auto falls back to the CPU; cpu is always there
    import torch

    if not torch.cuda.is_available():
        raise PreflightError(f"device {device}: no usable CUDA device on this host (torch {torch.__version__}, "
                             f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu or auto")
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise PreflightError(f"device {device}: this host has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


# FP8 E4M3 in Triton and torch._scaled_mm: Ada (8.9), Hopper and newer.
FP8_CAPABILITY = (8, 9)


def fp8_uses(config: Config, model_config: dict) -> list[str]:
    """What in the configuration asks for FP8 on the device: FP8 weights (the setting or an
    FP8 checkpoint) and an FP8 KV cache."""
    uses = []
    checkpoint = quantization.from_config(model_config, "config.json")
    if quantization.resolve(config.quantization, checkpoint) is not None:
        uses.append("an FP8 checkpoint" if checkpoint is not None else "quantization fp8")
    if config.kv_cache_dtype == "fp8":
        uses.append("kv_cache_dtype fp8")
    return uses


def check_fp8_device(config: Config, model_config: dict) -> None:
    """FP8 on a CUDA device that has no FP8 would fail in the workers, where the kernels
    compile; the CPU emulates FP8's numerics and needs no check."""
    uses = fp8_uses(config, model_config)
    if not uses or config.device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        return  # auto runs on the CPU; a configured CUDA device was refused by check_device
    index = int(config.device.partition(":")[2] or 0) if config.device.startswith("cuda") else 0
    check_fp8_capability(f"cuda:{index}", torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index),
                         uses)


def check_fp8_capability(device: str, name: str, capability: tuple[int, int], uses: list[str]) -> None:
    """Refuse `uses` (what asks for FP8) on a GPU of compute `capability` older than FP8_CAPABILITY."""
    if uses and tuple(capability) < FP8_CAPABILITY:
        need = ".".join(map(str, FP8_CAPABILITY))
        verb = "need" if len(uses) > 1 else "needs"
        raise PreflightError(f"{' and '.join(uses)} {verb} FP8 on the GPU (compute capability {need} and newer: Ada, "
                             f"Hopper, Blackwell); {device} is {name} ({capability[0]}.{capability[1]}): use "
                             f"quantization none and kv_cache_dtype auto, or --device cpu")


def model_max_len(model_config: dict) -> int | None:
    """The longest sequence the model's config.json allows (its positions, its sliding
    window), as the model loader reads it; None when it names neither."""
    limits = [v for k in ("max_position_embeddings", "sliding_window")
              if isinstance(v := model_config.get(k), int) and not isinstance(v, bool) and v > 0]
    return min(limits) if limits else None


def check_kv_cache(config: Config, model_config: dict) -> None:
    """With num_kv_blocks given, the KV cache must hold one sequence of max_model_len, and
    max_batch sequences (each holds at least one block) must fit in it."""
    blocks = config.num_kv_blocks
    if not blocks:
        return  # sized by the graph generator from the memory it finds
    limit = model_max_len(model_config)
    max_model_len = config.max_model_len or limit or 0
    if limit:
        max_model_len = min(max_model_len, limit)  # a larger setting is cut to the model's own limit
    tokens = blocks * config.block_size
    if max_model_len and tokens < max_model_len:
        needed = -(-max_model_len // config.block_size)
        raise PreflightError(f"num_kv_blocks {blocks} x block_size {config.block_size} = {tokens} tokens cannot hold "
                             f"one sequence of max_model_len {max_model_len}: give num_kv_blocks >= {needed}, or a "
                             f"smaller max_model_len")
    if config.max_batch > blocks:
        raise PreflightError(f"max_batch {config.max_batch} can never run: each sequence holds at least one KV block "
                             f"and num_kv_blocks is {blocks}: give max_batch <= {blocks}, or more num_kv_blocks")

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


def check_model_dir(model: Path) -> dict:
    """Check the model directory; its config.json's values."""
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
    try:
        quantization.from_config(values, str(config_file))
    except quantization.QuantizationError as error:
        raise PreflightError(str(error)) from None
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
    return values


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


def check_draft_model(draft: Path, model: Path, model_config: dict) -> None:
    """A draft proposes the model's token ids: it must be a model directory with the
    model's vocabulary size and the same tokenizer (its vocabulary and special tokens)."""
    try:
        draft_config = check_model_dir(draft)
    except PreflightError as error:
        raise PreflightError(f"speculative_draft_model: {error}") from None
    ours, theirs = model_config.get("vocab_size"), draft_config.get("vocab_size")
    if ours != theirs:
        raise PreflightError(f"speculative_draft_model {draft}: vocab_size {theirs} is not the model's {ours} "
                             f"(a draft needs the model's tokenizer)")
    if _tokenizer_identity(draft) != _tokenizer_identity(model):
        raise PreflightError(f"speculative_draft_model {draft}: its tokenizer is not the model's ({model}): "
                             f"a draft needs the model's tokenizer")


def check_eagle3_head(head: Path, model_config: dict) -> None:
    """An EAGLE-3 head reads the model's hidden states and proposes its token ids: its
    sizes must fit the model's."""
    if not head.is_dir():
        raise PreflightError(f"speculative_eagle3_head {head}: no such directory")
    try:
        read_head(head, model_config)
    except Eagle3HeadError as error:
        raise PreflightError(f"speculative_eagle3_head: {error}") from None


def _tokenizer_identity(model: Path) -> tuple:
    """What makes two tokenizers give the same ids: tokenizer.json's vocabulary, merges
    and added tokens, or else the bytes of the tokenizer file there is."""
    path = model / "tokenizer.json"
    if path.is_file():
        try:
            data = json.loads(path.read_bytes())
            body = data.get("model") or {}
            added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
            return ("tokenizer.json", json.dumps(body.get("vocab"), sort_keys=True),
                    json.dumps(body.get("merges")), tuple(added))
        except (OSError, ValueError, AttributeError, TypeError) as error:
            raise PreflightError(f"{path}: not a readable tokenizer ({error})") from None
    for name in TOKENIZER_FILES[1:]:
        if (model / name).is_file():
            return (name, (model / name).read_bytes())
    return ()
