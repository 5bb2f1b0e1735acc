"""The FP8 decode rule's config against the fastest, and the CUDA-core (fma) configs, at
every one-row product of an H100 re-timing (docs/lab/fp8_decode_h100_rule_check.json):
time over the product's fastest. Run from the repository root, no GPU needed."""
import json

decode = json.load(open("docs/lab/fp8_decode_h100_rule_check.json"))["decode"]
FIELDS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")


def name(c):
    return f"{c['kernel']} {c['block_n']}x{c['block_k']}/{c['split_k']} w{c['num_warps']} s{c['num_stages']}"


for key, product in decode.items():
    if not key.endswith(".m1"):
        continue
    timed = [c for c in product["candidates"] if "s" in c]
    fastest = min(c["s"] for c in timed)
    rule = [c for c in timed if all(f"{f}={c['config'][f]}," in product["rule"] for f in FIELDS)
            and f"kernel='{c['config']['kernel']}'" in product["rule"]]
    fma = sorted((c for c in timed if c["config"]["kernel"] == "fma"), key=lambda c: c["s"])[:3]
    print(f"{key:22s} rule {name(rule[0]['config']) if rule else '?'} {rule[0]['s'] / fastest if rule else float('nan'):.3f}"
          "  fma " + ", ".join(f"{name(c['config'])} {c['s'] / fastest:.3f}" for c in fma))
