"""The model configuration: what hybridd reads from a Hugging Face `config.json`.

Only the Llama family is supported (Llama 2/3, Mistral, Qwen2, Qwen3 dense); every field that
changes the computation is either understood here or rejected with an error that
names it, so a checkpoint never runs with silently wrong semantics.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hybridd.architectures import SUPPORTED_ARCHITECTURES
from hybridd.model.errors import ModelLoadError
from hybridd.quantization import Quantization, QuantizationError
from hybridd.quantization import from_config as quantization_from_config

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype, where: str = "dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ModelLoadError(f"{where}: unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN: the ramp between interpolated and extrapolated frequencies, and the factor
    # that scales cos and sin (transformers' `attention_factor`, from mscale when absent).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qkv_bias: bool
    tie_word_embeddings: bool
    dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    o_bias: bool = False  # Llama's attention_bias biases the output projection too
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k before RoPE
    quantization: Quantization | None = None  # what the checkpoint's quantization_config states
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """The longest sequence this model can serve, bounded by its sliding window."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def weight_bytes(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        total = self.num_layers * per_layer + v * h + h + (0 if self.tie_word_embeddings else v * h)
        return total * torch.finfo(self.dtype).bits // 8

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        def need(name: str, kind: type = int) -> Any:
            if name not in cfg or cfg[name] is None:
                raise ModelLoadError(f"{source}: missing required field {name!r}")
            value = cfg[name]
            if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ModelLoadError(f"{source}: field {name!r} must be a positive integer, got {value!r}")
            return value

        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or len(archs) != 1:
            raise ModelLoadError(f"{source}: field 'architectures' must list exactly one architecture, got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: field 'architectures': unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ModelLoadError(
                f"{source}: field 'num_key_value_heads' ({kv_heads!r}) must divide num_attention_heads ({heads})"
            )
        head_dim = cfg.get("head_dim") or hidden // heads
        if head_dim % 2:
            raise ModelLoadError(f"{source}: field 'head_dim' must be even for rotary embeddings, got {head_dim}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: field 'hidden_act': unsupported activation {act!r}; only 'silu'")
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"{source}: field 'mlp_bias': biased MLP projections are not supported")
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise ModelLoadError(f"{source}: field 'pretraining_tp' must be 1, got {cfg['pretraining_tp']!r}")

        o_bias = False
        if arch == "Qwen3ForCausalLM":
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            if cfg.get("use_sliding_window"):
                raise ModelLoadError(f"{source}: field 'use_sliding_window': sliding-window attention is not supported")
            sliding_window = None
        elif arch == "Qwen2ForCausalLM":
            qkv_bias = True
            if cfg.get("use_sliding_window"):
                raise ModelLoadError(f"{source}: field 'use_sliding_window': sliding-window attention is not supported")
            sliding_window = None
        else:
            # transformers' Mistral has no attention biases whatever the config says.
            qkv_bias = o_bias = arch == "LlamaForCausalLM" and bool(cfg.get("attention_bias", False))
            sliding_window = cfg.get("sliding_window")
            if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
                raise ModelLoadError(f"{source}: field 'sliding_window' must be a positive integer or null")

        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=need("max_position_embeddings"),
            rope=_parse_rope(cfg, source, need("max_position_embeddings")),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=parse_dtype(dtype_name, f"{source}: field 'dtype'"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_token_ids(cfg.get("eos_token_id"), source),
            sliding_window=sliding_window,
            quantization=_quantization(cfg, source),
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: config.json not found in the model directory")
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{path}: expected a JSON object at the top level")
        config = cls.from_dict(cfg, source=str(path))
        generation = _generation_config(Path(model_dir) / "generation_config.json")
        if generation.get("eos_token_id") is not None:
            # As in transformers' generate: generation_config.json's stop tokens, when it names any.
            eos = eos_token_ids(generation["eos_token_id"], str(Path(model_dir) / "generation_config.json"))
            config = replace(config, eos_token_ids=eos)
        return config


def _quantization(cfg: dict[str, Any], source: str) -> Quantization | None:
    try:
        return quantization_from_config(cfg, source)
    except QuantizationError as exc:
        raise ModelLoadError(str(exc)) from None


def eos_token_ids(value: Any, source: str) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: absent, one token id, or a list of them."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{source}: field 'eos_token_id' must be a token id or a list of them, got {value!r}")
    return tuple(values)


def chat_stop_strings(model_dir: str | Path) -> tuple[str, ...]:
    """Where the model's chat turn ends: generation_config.json's `chat_stop_strings` (a
    string or a list of them; hybridd's key, which transformers keeps as it is, unlike its
    own `stop_strings`, which every `generate` would apply and which needs a tokenizer
    there). A chat's answer stops there as at EOS: a model trained on text without an
    end-of-turn token (the embedded model's speeches end with a blank line, then the next
    speaker's name) declares its turn's end so."""
    path = Path(model_dir) / "generation_config.json"
    value = _generation_config(path).get("chat_stop_strings")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise ModelLoadError(f"{path}: field 'chat_stop_strings' must be a non-empty string or a list of them, "
                             f"got {value!r}")
    return tuple(values)


def _generation_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object at the top level")
    return data


def _parse_rope(cfg: dict[str, Any], source: str, max_position_embeddings: int) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints have
    # top-level `rope_theta` and an optional `rope_scaling`.
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source}: field 'rope_parameters' must be an object")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: field 'rope_scaling.rope_type': unsupported {rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (1, 1.0, None):
        raise ModelLoadError(
            f"{source}: field 'partial_rotary_factor': only 1.0 (RoPE over the whole head), got {partial!r}")
    rope = RopeConfig(theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), rope_type=rope_type)

    def positive(name: str, kind: type = float) -> Any:
        if params.get(name) is None:
            raise ModelLoadError(f"{source}: field 'rope_scaling.{name}' is required for {rope_type} rope")
        value = params[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ModelLoadError(f"{source}: field 'rope_scaling.{name}' must be a positive number, got {value!r}")
        return kind(value)

    if rope_type == "linear":
        return RopeConfig(theta=rope.theta, rope_type="linear", factor=positive("factor"))
    if rope_type == "llama3":
        return RopeConfig(
            theta=rope.theta,
            rope_type="llama3",
            factor=positive("factor"),
            low_freq_factor=positive("low_freq_factor"),
            high_freq_factor=positive("high_freq_factor"),
            original_max_position_embeddings=positive("original_max_position_embeddings", int),
        )
    if rope_type == "yarn":
        return _yarn(cfg, params, rope.theta, max_position_embeddings, positive, source)
    return rope


def _yarn(cfg: dict[str, Any], params: dict[str, Any], theta: float, max_position_embeddings: int,
          positive: Any, source: str) -> RopeConfig:
    """YaRN's parameters with transformers' defaults: the pre-training length from the
    top-level field, else the scaling's, else max_position_embeddings; the factor, when
    absent, the ratio of the two lengths; the attention factor, when absent, from mscale."""
    if cfg.get("original_max_position_embeddings") is not None:
        original = cfg["original_max_position_embeddings"]
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ModelLoadError(
                f"{source}: field 'original_max_position_embeddings' must be a positive integer, got {original!r}")
    elif params.get("original_max_position_embeddings") is not None:
        original = positive("original_max_position_embeddings", int)
    else:
        original = max_position_embeddings
    factor = positive("factor") if params.get("factor") is not None else max_position_embeddings / original

    def optional(name: str) -> float | None:
        return positive(name) if params.get(name) is not None else None

    attention_factor = optional("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = optional("mscale"), optional("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelLoadError(f"{source}: field 'rope_scaling.truncate' must be true or false, got {truncate!r}")
    beta_fast, beta_slow = optional("beta_fast") or 32.0, optional("beta_slow") or 1.0
    if beta_fast < beta_slow:
        raise ModelLoadError(
            f"{source}: field 'rope_scaling.beta_fast' ({beta_fast}) must not be below beta_slow ({beta_slow})")
    return RopeConfig(theta=theta, rope_type="yarn", factor=float(factor), original_max_position_embeddings=original,
                      beta_fast=beta_fast, beta_slow=beta_slow, truncate=truncate,
                      attention_factor=float(attention_factor))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` times longer (its paper's Eq. 21)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
