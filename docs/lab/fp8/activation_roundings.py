"""The embedded model with FP8 weights and its projections' inputs rounded to FP8 per token, per
group of columns, or on all projections but some: teacher-forced top-1 agreement and
perplexity against the unquantized model on the held-out windows of tests/test_fp8_accuracy.py
(`bf16`: the float32 and bfloat16 arithmetic rows too)."""
import json, math, sys, torch, torch.nn.functional as F
sys.path.insert(0, ".")  # run from the repository root
from hybridd.config import EMBEDDED_MODEL
from hybridd.model import load_model, load_tokenizer
from hybridd.kernels.fp8 import FP8_MAX, FP8_DTYPE
from tests.test_tiny_model_shipped import validation_token_ids
from tests.test_fp8_accuracy import _with_weights_of
from transformers import AutoModelForCausalLM
torch.set_grad_enabled(False)
record = json.loads((EMBEDDED_MODEL / "training.json").read_text())
ids = validation_token_ids(load_tokenizer(EMBEDDED_MODEL), record, EMBEDDED_MODEL)
w = record["validation_windows"]; seq_len = w["seq_len"]
starts = [w["first_start"] + i * w["stride"] for i in range(w["count"])]
ours = load_model(EMBEDDED_MODEL, dtype=torch.float32, quantization="fp8")
def q(x, group=None):
    x32 = x.float()
    shp = x32.shape
    if group: x32 = x32.reshape(*shp[:-1], shp[-1] // group, group)
    amax = x32.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return ((x32 / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s).reshape(shp).to(x.dtype)
def hooked(names, group=None, dtype=torch.float32):
    m = _with_weights_of(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32), ours).to(dtype).eval()
    for n, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(n.endswith(k) for k in names):
            mod.register_forward_pre_hook(lambda mod, a: (q(a[0], group),))
    return m
ref = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
variants = {
  "weights only": hooked([]),
  "all dynamic": hooked(["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]),
  "all but down": hooked(["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj"]),
  "all but o,down": hooked(["q_proj","k_proj","v_proj","gate_proj","up_proj"]),
  "all, group 64": hooked(["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"], 64),
  "all, group 32": hooked(["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"], 32),
}
if "bf16" in sys.argv:
    variants["all dynamic bf16"] = hooked(["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"], None, torch.bfloat16)
    variants["weights only bf16"] = hooked([], None, torch.bfloat16)
agree = {k: 0 for k in variants}; loss = {k: 0.0 for k in variants}; loss0 = 0.0; n = 0
for b in range(0, len(starts), 16):
    rows = torch.tensor([ids[s: s + seq_len + 1] for s in starts[b: b + 16]])
    t = rows[:, 1:].reshape(-1)
    l0 = ref(input_ids=rows[:, :-1], use_cache=False).logits.float().reshape(t.numel(), -1)
    loss0 += F.cross_entropy(l0, t, reduction="sum").item(); top0 = l0.argmax(-1)
    for k, m in variants.items():
        l = m(input_ids=rows[:, :-1], use_cache=False).logits.float().reshape(t.numel(), -1)
        loss[k] += F.cross_entropy(l, t, reduction="sum").item()
        agree[k] += int((l.argmax(-1) == top0).sum())
    n += t.numel()
for k in variants:
    print(f"{k:22s} top1 {agree[k]/n:.4f}  ppl ratio {math.exp((loss[k]-loss0)/n):.4f}")
