"""How a model's weights are quantized: FP8 at load (the `quantization` setting) or as an
FP8 checkpoint states it in `config.json`'s `quantization_config`, in the
compressed-tensors `float-quantized` format that llm-compressor writes. Every other
`quantization_config` is refused, naming it: a checkpoint never runs with its weights
misread.

What is quantized is always the decoder's linear projections (q, k, v, o, gate, up, down);
the embeddings, the norms and the LM head stay in the model's dtype.

Torch-free on purpose, as `hybridd.architectures`: the supervisor's preflight refuses a
checkpoint's quantization before it spawns a worker, and `hybridd.model.config` again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


METHODS = ("none", "fp8")  # the values of the `quantization` setting
_FORMAT = "compressed-tensors float-quantized (FP8 E4M3 weights per channel or per tensor)"


class QuantizationError(ValueError):
    """A quantization that cannot be served; the message names the field or setting."""


@dataclass(frozen=True)
class Quantization:
    """`method` "fp8"; `source` "load" (quantized as the weights load) or "checkpoint";
    `weights` "channel" or "tensor" (the checkpoint's scales; at load, always channel);
    `activations` one of `hybridd.kernels.fp8.ACTIVATIONS`."""

    method: str = "fp8"
    source: str = "load"
    weights: str = "channel"
    activations: str = "none"

    def describe(self, prefill_per_token: bool = False) -> str:
        """One line for the start-up log, `status` and `/v1/models`; `prefill_per_token`:
        the kernels quantize a prefill's activations to FP8 per token where the scheme
        leaves them in the model dtype (the GPU's FP8 × FP8 prefill, `fp8.product`)."""
        origin = "quantized at load" if self.source == "load" else "from the checkpoint"
        acts = {"none": "activations in the model dtype", "dynamic": "activations FP8 per token",
                "static": "activations FP8 with static scales"}[self.activations]
        if prefill_per_token and self.activations == "none":
            acts = "activations in the model dtype (FP8 per token in prefill)"
        return (f"fp8 e4m3 weights of the linear projections, scales per {self.weights} ({origin}); {acts}; "
                f"embeddings, norms and LM head in the model dtype")

    def facts(self) -> dict[str, str]:
        return {"method": self.method, "source": self.source, "weights": self.weights,
                "activations": self.activations}


def from_config(cfg: dict[str, Any], source: str) -> Quantization | None:
    """The quantization `config.json` states (None where it states none); anything but
    the compressed-tensors FP8 format raises QuantizationError naming the field."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    where = f"{source}: field 'quantization_config'"
    if not isinstance(qc, dict):
        raise QuantizationError(f"{where} must be an object")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise QuantizationError(f"{where}: quant_method {method!r} is not supported; supported: {_FORMAT}")
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise QuantizationError(f"{where}.format: {fmt!r} is not supported; supported: {_FORMAT}")
    ignore = qc.get("ignore") or []
    if ignore != ["lm_head"]:
        raise QuantizationError(f"{where}.ignore must be [\"lm_head\"] (every decoder projection FP8, the LM head "
                             f"in the model dtype), got {ignore!r}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise QuantizationError(f"{where}.config_groups must hold exactly one group, got {groups!r}")
    (name, group), = groups.items()
    where = f"{where}.config_groups.{name}"
    if not isinstance(group, dict):
        raise QuantizationError(f"{where} must be an object")
    if group.get("targets") != ["Linear"]:
        raise QuantizationError(f"{where}.targets must be [\"Linear\"], got {group.get('targets')!r}")
    weights = _float8(group.get("weights"), f"{where}.weights", strategies=("channel", "tensor"), dynamic=False)
    activations = "none"
    acts = group.get("input_activations")
    if acts is not None:
        strategy = _float8(acts, f"{where}.input_activations", strategies=("token", "tensor"), dynamic=None)
        activations = "dynamic" if strategy == "token" else "static"
        if (activations == "dynamic") != bool(acts.get("dynamic")):
            raise QuantizationError(f"{where}.input_activations: strategy {strategy!r} must be "
                                 f"{'dynamic' if strategy == 'token' else 'static'}")
    if group.get("output_activations") is not None:
        raise QuantizationError(f"{where}.output_activations: quantized outputs are not supported")
    return Quantization(source="checkpoint", weights=weights, activations=activations)


def _float8(spec: Any, where: str, strategies: tuple[str, ...], dynamic: bool | None) -> str:
    """The strategy of an 8-bit symmetric float quantization `spec` (whose `dynamic` must
    be `dynamic`, unless None)."""
    if not isinstance(spec, dict):
        raise QuantizationError(f"{where} must be an object")
    if spec.get("num_bits") != 8 or spec.get("type") != "float":
        raise QuantizationError(f"{where}: only 8-bit float (FP8 E4M3) is supported, got num_bits "
                             f"{spec.get('num_bits')!r}, type {spec.get('type')!r}")
    if spec.get("symmetric") is False:
        raise QuantizationError(f"{where}.symmetric: asymmetric FP8 is not supported")
    if spec.get("strategy") not in strategies:
        raise QuantizationError(f"{where}.strategy: {spec.get('strategy')!r} is not supported; "
                             f"supported: {', '.join(strategies)}")
    if dynamic is not None and bool(spec.get("dynamic", False)) != dynamic:
        raise QuantizationError(f"{where}.dynamic: {spec.get('dynamic')!r} does not fit strategy {spec['strategy']!r}")
    return spec["strategy"]


def resolve(setting: str | None, checkpoint: Quantization | None) -> Quantization | None:
    """The quantization a model runs with: the checkpoint's, where it has one (an FP8
    checkpoint is FP8 whatever the setting), else the `quantization` setting's."""
    setting = setting or "none"
    if setting not in METHODS:
        raise QuantizationError(f"quantization must be one of {', '.join(METHODS)}, got {setting!r}")
    if checkpoint is not None:
        return checkpoint
    return Quantization() if setting == "fp8" else None
