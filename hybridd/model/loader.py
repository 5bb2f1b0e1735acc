"""Loading a Llama-family model from a local Hugging Face directory.

The model is built on the meta device and materialised empty in the target dtype
and device; each checkpoint tensor is then read once from safetensors (single file
or shards with their index) and copied into its place, fused projections included.
No full second copy of the weights ever exists in memory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hybridd.kernels.choices import KernelChoices
from hybridd.kernels.fp8 import FP8_DTYPE, quantize_rows
from hybridd.log import get_logger
from hybridd.model.config import ModelConfig, parse_dtype
from hybridd.model.errors import ModelLoadError
from hybridd.model.llama import LlamaModel
from hybridd.quantization import QuantizationError
from hybridd.quantization import resolve as resolve_quantization

log = get_logger("loader")

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it (via the index when sharded)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = {}
        for name, shard in weight_map.items():
            path = model_dir / shard
            if not path.is_file():
                raise ModelLoadError(f"{index}: shard {shard!r} (holding {name!r}) is missing")
            files[name] = path
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files found")
    files = {}
    for path in shards:
        for name in _open(path).keys():
            files[name] = path
    return files


def _open(path: Path, device: str = "cpu"):
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read safetensors file ({exc})") from exc


class _Target(NamedTuple):
    """Where a checkpoint tensor goes: `param`'s rows `rows` (all: None), a projection's
    tensor of kind `kind` ("weight", "bias", "weight_scale", "input_scale") for the `part`-th
    projection fused into `module`, or a plain parameter (`module` None)."""

    param: torch.Tensor | None
    rows: slice | None = None
    module: nn.Module | None = None
    kind: str = ""
    part: int = 0


def _target(model: LlamaModel, config: ModelConfig, name: str) -> _Target | None:
    if name == "model.embed_tokens.weight":
        return _Target(model.embed_tokens.weight)
    if name == "model.norm.weight":
        return _Target(model.norm.weight)
    if name == "lm_head.weight":
        return _Target(None if config.tie_word_embeddings else model.lm_head.weight)
    m = _LAYER.match(name)
    if not m:
        return None
    index, rest = int(m.group(1)), m.group(2)
    if index >= config.num_layers:
        return None
    layer = model.layers[index]
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    projections = {  # checkpoint module → (fused module, its rows, which part of it)
        "self_attn.q_proj": (layer.qkv_proj, slice(0, q), 0),
        "self_attn.k_proj": (layer.qkv_proj, slice(q, q + kv), 1),
        "self_attn.v_proj": (layer.qkv_proj, slice(q + kv, q + 2 * kv), 2),
        "self_attn.o_proj": (layer.o_proj, None, 0),
        "mlp.gate_proj": (layer.gate_up_proj, slice(0, inter), 0),
        "mlp.up_proj": (layer.gate_up_proj, slice(inter, 2 * inter), 1),
        "mlp.down_proj": (layer.down_proj, None, 0),
    }
    norms = {"input_layernorm.weight": layer.input_layernorm, "post_attention_layernorm.weight":
             layer.post_attention_layernorm}
    if config.qk_norm:
        norms |= {"self_attn.q_norm.weight": layer.q_norm, "self_attn.k_norm.weight": layer.k_norm}
    if rest in norms:
        return _Target(norms[rest].weight)
    module_name, _, kind = rest.rpartition(".")
    if module_name in projections:
        module, rows, part = projections[module_name]
        param = getattr(module, kind, None)
        if not isinstance(param, torch.Tensor):
            return None
        return _Target(param, rows, module, kind, part)
    return None


def _store(target: _Target, tensor: torch.Tensor, where: str, quantize: bool) -> None:
    """Copy a checkpoint tensor into its place: an FP8 projection's weight as it is (an FP8
    checkpoint) or, where `quantize`, quantized per row here; scales per tensor broadcast
    to the rows."""
    dest = target.param if target.rows is None else target.param[target.rows]
    if target.kind == "input_scale":
        if tensor.numel() != 1:
            raise ModelLoadError(f"{where} must hold one static scale, has shape {tuple(tensor.shape)}")
        target.param[target.part] = tensor.reshape(()).float()
        return
    if target.kind == "weight_scale":
        if tensor.numel() not in (1, dest.numel()):
            raise ModelLoadError(f"{where} has shape {tuple(tensor.shape)}: expected one scale per tensor or "
                                 f"one per output channel ({dest.numel()})")
        dest.copy_(tensor.float().reshape(-1).expand(dest.numel()))
        return
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ModelLoadError(f"{where} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    if target.kind == "weight" and dest.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
        if quantize:
            weight, scale = quantize_rows(tensor.to(dest.device))
            dest.copy_(weight)
            scales = target.module.weight_scale
            (scales if target.rows is None else scales[target.rows]).copy_(scale)
            return
        raise ModelLoadError(f"{where} is {tensor.dtype}, expected float8_e4m3fn as quantization_config states")
    if target.kind == "weight" and tensor.dtype == FP8_DTYPE and dest.dtype != FP8_DTYPE:
        raise ModelLoadError(f"{where} is float8_e4m3fn but config.json states no quantization_config for it")
    dest.copy_(tensor)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    kernels: KernelChoices | str = "auto",
    quantization: str | None = None,
) -> LlamaModel:
    """The model of `model_dir` on `device`; `max_positions` and `kernels` as `LlamaModel`
    takes them; `quantization` "fp8" (the setting) quantizes a checkpoint's projections to
    FP8 as they load, and an FP8 checkpoint is FP8 whatever it says. Where the kernels fuse
    the norm into the projections (`gemm_fusions`' `norm`), the norms' weights are folded
    into them here."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory does not exist")
    config = ModelConfig.from_dir(model_dir)
    dtype = parse_dtype(dtype) if dtype is not None else config.dtype
    device = torch.device(device)

    try:
        scheme = resolve_quantization(quantization, config.quantization)
    except QuantizationError as exc:
        raise ModelLoadError(str(exc)) from None
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaModel(config, device, max_positions, kernels, scheme)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight

    expected = expected_tensor_names(config)
    files = checkpoint_files(model_dir)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    read_device = str(device) if device.type == "cuda" else "cpu"
    quantize = scheme is not None and scheme.source == "load"
    with torch.no_grad():
        for path, names in by_file.items():
            handle = _open(path, read_device)
            for name in names:
                if _IGNORED.search(name):
                    continue
                target = _target(model, config, name)
                if target is None:
                    raise ModelLoadError(f"{path}: unexpected tensor {name!r} for {config.architecture}")
                if target.param is None:
                    continue  # tied lm_head stored anyway
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                    raise ModelLoadError(f"{path}: cannot read tensor {name!r} ({exc})") from exc
                _store(target, tensor, f"{path}: tensor {name!r}", quantize)
                expected.discard(name)
    if expected:
        missing = sorted(expected)
        raise ModelLoadError(f"{model_dir}: checkpoint lacks tensor(s) {', '.join(missing[:8])}")
    model.eval()
    if "norm" in model.kernels.fusions:
        model.fold_norms()
    log.info("model_loaded", path=str(model_dir), arch=config.architecture, dtype=str(dtype), device=str(device),
             quantization=scheme.describe(model.kernels.fp8_prefill_per_token) if scheme is not None else "none")
    return model


def expected_tensor_names(config: ModelConfig) -> set[str]:
    """The checkpoint tensors a model of this config must provide."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        names.update(prefix + n for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        ))
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.add(f"{prefix}self_attn.{proj}.weight")
            if config.qkv_bias:
                names.add(f"{prefix}self_attn.{proj}.bias")
        if config.o_bias:
            names.add(f"{prefix}self_attn.o_proj.bias")
        if config.quantization is not None:
            static = config.quantization.activations == "static"
            for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                names.add(f"{prefix}{proj}.weight_scale")
                if static:
                    names.add(f"{prefix}{proj}.input_scale")
        if config.qk_norm:
            names.update(f"{prefix}self_attn.{norm}.weight" for norm in ("q_norm", "k_norm"))
    return names
