"""What an EAGLE-3 draft head is on disk, and whether it fits a model: torch-free, so that
the supervisor's preflight refuses a head that cannot serve before any worker starts.

The published format (EAGLE-3, as SGLang's and vLLM's `LlamaForCausalLMEagle3` load it) is
a directory with a Llama-style `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`,
`num_hidden_layers` 1, `draft_vocab_size`, optionally `target_hidden_size` and the target
layers it reads, `eagle_aux_hidden_state_layer_ids`) and a safetensors file holding
`fc.weight` [hidden, 3 x target hidden], one decoder layer `midlayer.*` whose q/k/v read
2 x hidden, `norm.weight`, `lm_head.weight` [draft vocab, hidden], `d2t` [draft vocab]
(draft id + d2t[id] = the target's id), `t2d` (unused) and, where the head does not
share the target's, `embed_tokens.weight`. Tensor names may carry a `model.` prefix.

The target layers default to vLLM's and SGLang's choice: the residual stream entering
layers 2, L // 2 and L - 3 of an L-layer target (an id j is the stream after j layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"


class Eagle3HeadError(ValueError):
    """A head that cannot be used with this model; the message names the field or tensor."""


@dataclass(frozen=True)
class Eagle3HeadSpec:
    """A head's sizes, as its config states them and its tensors confirm."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary, which d2t maps into
    draft_vocab_size: int
    rms_norm_eps: float
    aux_layers: tuple[int, int, int]
    has_embeddings: bool  # else the target's embedding is the head's
    has_d2t: bool  # else draft ids are the target's (draft_vocab_size == vocab_size)
    norm_before_residual: bool
    config: dict[str, Any]

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the head needs, by its name without a prefix, and its shape."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        shapes = {
            "fc.weight": (h, 3 * self.target_hidden_size),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (q, 2 * h),
            "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, q),
            "midlayer.mlp.gate_proj.weight": (i, h),
            "midlayer.mlp.up_proj.weight": (i, h),
            "midlayer.mlp.down_proj.weight": (h, i),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
        }
        if self.has_embeddings:
            shapes["embed_tokens.weight"] = (self.vocab_size, h)
        if self.has_d2t:
            shapes["d2t"] = (self.draft_vocab_size,)
        return shapes


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from a safetensors file's header (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (OSError, SafetensorError) as error:
        raise Eagle3HeadError(f"{path}: not a readable safetensors file ({error})") from None


def read_head(head_dir: str | Path, target: dict[str, Any]) -> Eagle3HeadSpec:
    """The head in `head_dir` checked against the target's `config.json` (a dict): its
    config, its tensors' names and shapes, and that every size fits the target."""
    head_dir = Path(head_dir)
    where = f"EAGLE-3 head {head_dir}"
    config_path, weights = head_dir / "config.json", head_dir / WEIGHTS
    if not config_path.is_file():
        raise Eagle3HeadError(f"{where}: no config.json (a directory in the published EAGLE-3 format)")
    try:
        cfg = json.loads(config_path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as error:
        raise Eagle3HeadError(f"{config_path}: not a readable config ({error})") from None
    if not weights.is_file():
        found = sorted(p.name for p in head_dir.iterdir() if p.suffix in (".bin", ".pt", ".safetensors"))
        raise Eagle3HeadError(f"{where}: no {WEIGHTS} (found {', '.join(found) or 'no weights'}); a pickled "
                              f"pytorch_model.bin is converted once with safetensors.torch.save_file")

    def positive(name: str, default: Any = None) -> int:
        value = cfg.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise Eagle3HeadError(f"{config_path}: field {name!r} must be a positive integer, got {value!r}")
        return value

    archs = cfg.get("architectures")
    if archs != [ARCHITECTURE]:
        raise Eagle3HeadError(f"{config_path}: field 'architectures' is {archs!r}, expected [{ARCHITECTURE!r}]")
    if positive("num_hidden_layers") != 1:
        raise Eagle3HeadError(f"{config_path}: field 'num_hidden_layers' is {cfg['num_hidden_layers']}; "
                              f"hybridd runs EAGLE-3 heads of one decoder layer")
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise Eagle3HeadError(f"{config_path}: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 head); "
                              f"hybridd runs EAGLE-3 heads")
    for name in ("attention_bias", "mlp_bias", "bias"):
        if cfg.get(name):
            raise Eagle3HeadError(f"{config_path}: field {name!r} is true; hybridd's EAGLE-3 head has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise Eagle3HeadError(f"{config_path}: field 'hidden_act' is {cfg['hidden_act']!r}, expected 'silu'")
    hidden = positive("hidden_size")
    heads = positive("num_attention_heads")
    vocab = positive("vocab_size")
    draft_vocab = positive("draft_vocab_size", vocab) if cfg.get("draft_vocab_size") is not None else vocab
    num_layers = target.get("num_hidden_layers")
    aux = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
    if aux is None:
        if not isinstance(num_layers, int) or num_layers < 3:
            raise Eagle3HeadError(f"{where}: the model has {num_layers} layers; an EAGLE-3 head reads layers 2, L/2 "
                                  f"and L-3 of a model of at least 3 (or names eagle_aux_hidden_state_layer_ids)")
        aux = default_aux_layers(num_layers)
    if (not isinstance(aux, (list, tuple)) or len(aux) != 3
            or not all(isinstance(a, int) and not isinstance(a, bool) and 0 <= a < (num_layers or 0) for a in aux)):
        raise Eagle3HeadError(f"{config_path}: eagle_aux_hidden_state_layer_ids {aux!r} must be 3 layer ids in "
                              f"0..{(num_layers or 0) - 1} (the model's layers)")
    shapes = safetensors_shapes(weights)
    names = {name.removeprefix("model."): shape for name, shape in shapes.items()}
    spec = Eagle3HeadSpec(
        hidden_size=hidden,
        target_hidden_size=positive("target_hidden_size", hidden),
        intermediate_size=positive("intermediate_size"),
        num_heads=heads,
        num_kv_heads=positive("num_key_value_heads", heads),
        head_dim=positive("head_dim", hidden // heads) if cfg.get("head_dim") is not None else hidden // heads,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        aux_layers=(aux[0], aux[1], aux[2]),
        has_embeddings="embed_tokens.weight" in names,
        has_d2t="d2t" in names,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        config=cfg,
    )
    check_fits(spec, target, where)
    for name, shape in spec.tensor_shapes().items():
        if name not in names:
            raise Eagle3HeadError(f"{weights}: lacks tensor {name!r}")
        if names[name] != shape:
            raise Eagle3HeadError(f"{weights}: tensor {name!r} has shape {list(names[name])}, the config and "
                                  f"model make it {list(shape)}")
    if not spec.has_d2t and draft_vocab != vocab:
        raise Eagle3HeadError(f"{weights}: lacks tensor 'd2t' (draft_vocab_size {draft_vocab} is not vocab_size "
                              f"{vocab}: draft ids need their map to the model's)")
    return spec


def check_fits(spec: Eagle3HeadSpec, target: dict[str, Any], where: str) -> None:
    """The head's sizes against the target's config.json: one line naming the mismatch."""
    target_hidden, target_vocab = target.get("hidden_size"), target.get("vocab_size")
    if spec.target_hidden_size != target_hidden:
        raise Eagle3HeadError(f"{where}: reads hidden states of size {spec.target_hidden_size} "
                              f"(target_hidden_size), the model's hidden_size is {target_hidden}")
    if spec.vocab_size != target_vocab:
        raise Eagle3HeadError(f"{where}: vocab_size {spec.vocab_size} is not the model's {target_vocab} "
                              f"(a head proposes the model's token ids)")
    if spec.draft_vocab_size > spec.vocab_size:
        raise Eagle3HeadError(f"{where}: draft_vocab_size {spec.draft_vocab_size} exceeds vocab_size "
                              f"{spec.vocab_size}")
    if not spec.has_embeddings and spec.hidden_size != target_hidden:
        raise Eagle3HeadError(f"{where}: has no embed_tokens of its own and its hidden_size {spec.hidden_size} is "
                              f"not the model's {target_hidden} (it would embed with the model's)")
    if spec.num_heads % spec.num_kv_heads:
        raise Eagle3HeadError(f"{where}: num_key_value_heads {spec.num_kv_heads} does not divide "
                              f"num_attention_heads {spec.num_heads}")
