"""FP8 weights on the CPU: the `quantization = "fp8"` load (the decoder's projections FP8
E4M3 with a float32 scale per output channel, the rest in the model's dtype) and FP8
checkpoints in the compressed-tensors format, each against transformers' own model with
the same quantization applied to its weights (and its activations, where the checkpoint
quantizes them): the emulated numerics are the reference the GPU kernels are held to."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridd.engine.generate import greedy_generate
from hybridd.kernels import fp8
from hybridd.model import KVCache, ModelLoadError, StepInputs, load_model
from tests.test_model_correctness import REL_TOL, prompts, reference_greedy, rel_err
from tests.tiny_models import build_tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_projection(name: str) -> bool:
    return any(f".{p}." in name for p in PROJECTIONS) and name.endswith(".weight")


def _fake_quantized(model_dir, weight_scales=None, input_scales=None, activations="none"):
    """transformers' model of `model_dir` with each projection's weight replaced by its FP8
    round trip (per row, or with the given `weight_scales`), and its input rounded through
    FP8 where `activations` says so: per token, or with `input_scales`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not _is_projection(name):
                continue
            if weight_scales is None:
                q, scale = fp8.quantize_rows(param)
            else:
                scale = weight_scales[name].float().reshape(-1).expand(param.shape[0])
                q = (param / scale[:, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
            param.copy_(q.float() * scale[:, None])
    if activations != "none":
        for name, module in model.named_modules():
            if name.rpartition(".")[2] not in PROJECTIONS:
                continue

            def round_input(module, args, name=name):
                x = args[0]
                if activations == "dynamic":
                    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / fp8.FP8_MAX
                else:
                    scale = input_scales[name + ".input_scale"].float()
                return ((x / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE).float() * scale,)

            module.register_forward_pre_hook(round_input)
    return model


@torch.inference_mode()
def _prefill_logits(model, prompt):
    kv = KVCache.allocate(model.config, 8, 16, model.dtype, "cpu")
    return model.compute_logits(model(StepInputs.prefill([prompt], [[4, 0, 6, 2, 1]], 16), kv))


# ---------------------------------------------------------------- the numerics


def test_quantize_rows_scales_each_row_by_its_amax_and_rounds_to_nearest():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 2, 64)[:, None]  # rows six decades apart
    w[5] = 0.0
    q, scale = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.dtype == torch.float32
    expected = w.abs().amax(1) / 448
    expected[5] = 1.0
    torch.testing.assert_close(scale, expected, rtol=0, atol=0)
    assert (q.float().abs().amax(1)[torch.arange(64) != 5] == 448).all()  # each row's largest reaches 448
    back = fp8.dequantize(fp8.Fp8Weight(q, scale))
    # E4M3 keeps 3 mantissa bits: half a unit in the last place is 2^-4 of the value, and
    # below the smallest normal (2^-6) the spacing is 2^-9, in units of the row's scale.
    bound = torch.maximum(w.abs() * 2**-4, scale[:, None] * 2**-10)
    assert ((back - w).abs() <= bound).all()
    assert (back[5] == 0).all()


def test_fp8_linear_is_float32_over_the_dequantized_weight_rounded_to_the_activation_dtype():
    torch.manual_seed(1)
    weight = fp8.Fp8Weight(*fp8.quantize_rows(torch.randn(48, 40)))
    x = torch.randn(7, 40).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    got = fp8.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16
    expected = (x.float() @ fp8.dequantize(weight).T + bias.float()).to(torch.bfloat16)
    assert torch.equal(got, expected)
    # Per-token activations: each row through FP8 at its own scale.
    dynamic = weight._replace(activations="dynamic")
    xq = torch.stack([(r / (r.abs().max() / 448)).to(fp8.FP8_DTYPE).float() * (r.abs().max() / 448)
                      for r in x.float()])
    assert torch.equal(fp8.linear(x, dynamic), (xq @ fp8.dequantize(weight).T).to(torch.bfloat16))


# ---------------------------------------------------------------- quantization = "fp8" at load


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def quantized(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"fp8-{request.param}")
    build_tiny_model(request.param, path)
    return path, load_model(path, dtype=torch.float32, quantization="fp8"), _fake_quantized(path)


def test_projections_are_stored_in_fp8_and_the_rest_in_the_model_dtype(quantized):
    path, ours, _ = quantized
    plain = load_model(path, dtype=torch.float32)
    assert ours.quantization.method == "fp8" and ours.quantization.source == "load"
    assert plain.quantization is None
    for layer, plain_layer in zip(ours.layers, plain.layers, strict=True):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            proj, reference = getattr(layer, name), getattr(plain_layer, name)
            assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight.shape == reference.weight.shape
            assert proj.weight_scale.dtype == torch.float32 and proj.weight_scale.shape == (proj.weight.shape[0],)
            # Fused projections scale each checkpoint row by its own amax: the row scales are
            # those of the unfused q, k, v (gate, up) weights.
            torch.testing.assert_close(proj.weight_scale, reference.weight.abs().amax(1) / 448, rtol=0, atol=0)
        assert layer.input_layernorm.weight.dtype == torch.float32
    assert ours.embed_tokens.weight.dtype == ours.lm_head.weight.dtype == ours.norm.weight.dtype == torch.float32
    def projection_bytes(model) -> int:
        return sum(p.numel() * p.element_size() for n, p in model.layers.named_parameters()
                   if n.endswith("_proj.weight"))

    assert projection_bytes(ours) * 4 == projection_bytes(plain)  # float32 here; a bfloat16 model's halve


def test_fp8_model_matches_transformers_with_the_same_weights_rounded(quantized):
    path, ours, reference = quantized
    prompt = prompts(1, seed=8, lo=50, hi=51)[0]
    expected = reference(torch.tensor([prompt])).logits[0]
    assert rel_err(_prefill_logits(ours, prompt), expected) <= REL_TOL
    # ... and the rounding is there to see: the unquantized model is farther away.
    assert rel_err(_prefill_logits(load_model(path, dtype=torch.float32), prompt), expected) > 10 * REL_TOL


def test_fp8_model_greedy_single_and_batched_through_the_kv_cache(quantized):
    _, ours, reference = quantized
    batch = prompts(3, seed=12)
    together = greedy_generate(ours, batch, 24, block_size=8)
    for prompt, got in zip(batch, together, strict=True):
        assert got == reference_greedy(reference, prompt, 24)[0]


def test_bfloat16_fp8_model_rounds_the_products_to_bfloat16(tmp_path):
    build_tiny_model("llama", tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16, quantization="fp8")
    reference = load_model(tmp_path, dtype=torch.float32, quantization="fp8")
    assert ours.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn and ours.dtype == torch.bfloat16
    prompt = prompts(1, seed=2, lo=30, hi=31)[0]
    got, expected = _prefill_logits(ours, prompt), _prefill_logits(reference, prompt)
    assert 1e-4 < rel_err(got, expected) < 0.05  # bfloat16 activations: close, not equal


def test_unknown_quantization_is_refused(tmp_path):
    build_tiny_model("llama", tmp_path)
    with pytest.raises(ModelLoadError, match="quantization must be one of none, fp8, got 'int4'"):
        load_model(tmp_path, quantization="int4")


# ---------------------------------------------------------------- FP8 checkpoints (compressed-tensors)


def _write_fp8_checkpoint(path, weights: str, activations: str) -> tuple[dict, dict]:
    """Rewrite the tiny model at `path` as llm-compressor writes an FP8 checkpoint: each
    projection's weight in float8_e4m3fn with its `weight_scale` (per channel [N, 1], per
    tensor [1]) and, for static activations, its `input_scale` (the same for the
    projections that read the same input, as calibration gives them); the config's
    `quantization_config` in the compressed-tensors `float-quantized` format."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    weight_scales, input_scales = {}, {}
    for name in list(tensors):
        if not _is_projection(name):
            continue
        w = tensors[name].float()
        if weights == "channel":
            scale = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
        else:
            scale = (w.abs().amax() / 448).reshape(1).to(torch.bfloat16)
        s = scale.float().reshape(-1, 1)
        tensors[name] = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        module = name.removesuffix(".weight")
        tensors[module + ".weight_scale"] = weight_scales[name] = scale
        if activations == "static":
            reads = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # the same input
            leaf = module.rpartition(".")[2]
            value = {"q_proj": 0.011, "o_proj": 0.004, "gate_proj": 0.013, "down_proj": 0.002}[reads.get(leaf, leaf)]
            tensors[module + ".input_scale"] = input_scales[module + ".input_scale"] = torch.tensor([value])
    save_file(tensors, file, metadata={"format": "pt"})
    acts = {"none": None,
            "dynamic": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True,
                        "observer": None},
            "static": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False,
                       "observer": "minmax"}}[activations]
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None, "input_activations": acts,
            "weights": {"num_bits": 8, "type": "float", "strategy": weights, "symmetric": True, "dynamic": False,
                        "group_size": None, "observer": "minmax"},
        }},
    }
    (path / "config.json").write_text(json.dumps(config))
    return weight_scales, input_scales


@pytest.mark.parametrize(("weights", "activations"), [("channel", "dynamic"), ("channel", "none"),
                                                       ("tensor", "static")])
def test_compressed_tensors_fp8_checkpoint_loads_and_matches_its_dequantized_reference(tmp_path, weights, activations):
    build_tiny_model("qwen3", tmp_path / "original")
    shutil.copytree(tmp_path / "original", tmp_path / "fp8")
    weight_scales, input_scales = _write_fp8_checkpoint(tmp_path / "fp8", weights, activations)
    reference = _fake_quantized(tmp_path / "original", weight_scales, input_scales, activations)
    for setting in (None, "fp8"):  # an FP8 checkpoint is FP8 whatever the setting says
        ours = load_model(tmp_path / "fp8", dtype=torch.float32, quantization=setting)
        assert ours.quantization.source == "checkpoint"
        assert (ours.quantization.weights, ours.quantization.activations) == (weights, activations)
        assert ours.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn
        prompt = prompts(1, seed=6, lo=40, hi=41)[0]
        assert rel_err(_prefill_logits(ours, prompt), reference(torch.tensor([prompt])).logits[0]) <= REL_TOL
    assert greedy_generate(ours, [prompt], 16)[0] == reference_greedy(reference, prompt, 16)[0]


@pytest.mark.parametrize(("quantization_config", "message"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "field 'quantization_config': quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "field 'quantization_config': quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "field 'quantization_config': quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "field 'quantization_config': quant_method 'fp8'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, r"quantization_config'\.format: 'pack"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                       "symmetric": True}}}},
     r"config_groups\.group_0\.weights\.strategy: 'block'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}},
     r"group_0\.weights: only 8-bit float"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": [], "config_groups": {}},
     r"quantization_config'\.ignore must be \[\"lm_head\"\]"),
])
def test_other_quantization_configs_are_refused_naming_them(tmp_path, quantization_config, message):
    build_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message) as refusal:
        load_model(tmp_path)
    assert "\n" not in str(refusal.value)


def test_fp8_tensors_without_a_quantization_config_are_refused(tmp_path):
    build_tiny_model("llama", tmp_path)
    _write_fp8_checkpoint(tmp_path, "channel", "none")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    refusal = "float8_e4m3fn but config.json states no quantization_config|unexpected tensor .*weight_scale"
    with pytest.raises(ModelLoadError, match=refusal):
        load_model(tmp_path)
