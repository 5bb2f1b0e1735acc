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

import torch
from safetensors import SafetensorError, safe_open

from hybridd.kernels.choices import KernelChoices
from hybridd.log import get_logger
from hybridd.model.config import ModelConfig, parse_dtype
from hybridd.model.errors import ModelLoadError
from hybridd.model.llama import LlamaModel

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


def _target(model: LlamaModel, config: ModelConfig, name: str) -> tuple[torch.Tensor, slice | None] | None:
    """Where a checkpoint tensor goes: (parameter, row slice for fused projections)."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, None
    if name == "model.norm.weight":
        return model.norm.weight, None
    if name == "lm_head.weight":
        return (None, None) if config.tie_word_embeddings else (model.lm_head.weight, None)
    m = _LAYER.match(name)
    if not m:
        return None
    index, rest = int(m.group(1)), m.group(2)
    if index >= config.num_layers:
        return None
    layer = model.layers[index]
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    fused = {
        "self_attn.q_proj": (layer.qkv_proj, slice(0, q)),
        "self_attn.k_proj": (layer.qkv_proj, slice(q, q + kv)),
        "self_attn.v_proj": (layer.qkv_proj, slice(q + kv, q + 2 * kv)),
        "mlp.gate_proj": (layer.gate_up_proj, slice(0, inter)),
        "mlp.up_proj": (layer.gate_up_proj, slice(inter, 2 * inter)),
    }
    plain = {
        "self_attn.o_proj.weight": layer.o_proj.weight,
        "self_attn.o_proj.bias": layer.o_proj.bias,
        "mlp.down_proj.weight": layer.down_proj.weight,
        "input_layernorm.weight": layer.input_layernorm.weight,
        "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
    }
    if config.qk_norm:
        plain["self_attn.q_norm.weight"] = layer.q_norm.weight
        plain["self_attn.k_norm.weight"] = layer.k_norm.weight
    if plain.get(rest) is not None:
        return plain[rest], None
    module_name, _, kind = rest.rpartition(".")
    if module_name in fused:
        module, rows = fused[module_name]
        param = getattr(module, kind, None)
        if param is None:
            return None
        return param, rows
    return None


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    kernels: KernelChoices | str = "auto",
) -> LlamaModel:
    """The model of `model_dir` on `device`; `max_positions` and `kernels` as `LlamaModel`
    takes them. Where the kernels fuse the norm into the projections (`gemm_fusions`'
    `norm`), the norms' weights are folded into them here."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory does not exist")
    config = ModelConfig.from_dir(model_dir)
    dtype = parse_dtype(dtype) if dtype is not None else config.dtype
    device = torch.device(device)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaModel(config, device, max_positions, kernels)
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
    with torch.no_grad():
        for path, names in by_file.items():
            handle = _open(path, read_device)
            for name in names:
                if _IGNORED.search(name):
                    continue
                target = _target(model, config, name)
                if target is None:
                    raise ModelLoadError(f"{path}: unexpected tensor {name!r} for {config.architecture}")
                param, rows = target
                if param is None:
                    continue  # tied lm_head stored anyway
                dest = param if rows is None else param[rows]
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                    raise ModelLoadError(f"{path}: cannot read tensor {name!r} ({exc})") from exc
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                expected.discard(name)
    if expected:
        missing = sorted(expected)
        raise ModelLoadError(f"{model_dir}: checkpoint lacks tensor(s) {', '.join(missing[:8])}")
    model.eval()
    if "norm" in model.kernels.fusions:
        model.fold_norms()
    log.info("model_loaded", path=str(model_dir), arch=config.architecture, dtype=str(dtype), device=str(device))
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
        if config.qk_norm:
            names.update(f"{prefix}self_attn.{norm}.weight" for norm in ("q_norm", "k_norm"))
    return names
