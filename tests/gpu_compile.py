"""Compiles Triton kernels for a CUDA GPU on a host without one (tests/test_kernels_compile_for_gpu.py).

Run as `python -m tests.gpu_compile` with the cases as JSON on stdin (a list of
{"id", "kernel": "module:function", "constexprs", "pointers", "capability", "num_warps",
"num_stages"}); prints {id: "ok" or the error} as JSON. A child process, because the
test suite runs Triton's interpreter (TRITON_INTERPRET=1), under which `triton.jit` gives
functions the compiler does not take.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys

# Scalars that are not 32-bit integers; any other parameter not named `*_ptr` is one.
FLOATS = {"scale", "qk_scale", "eps"}


def compile_for(kernel, constexprs: dict, pointers: dict[str, str], capability: int, num_warps: int,
                num_stages: int) -> None:
    """`kernel` compiled to cubin for a CUDA GPU of `capability` (e.g. 90): every parameter is
    a constexpr given here, a pointer (`pointers`' element type, else bf16) or a scalar."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, "bf16")
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    names = list(signature)
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    if not compiled.asm.get("cubin"):
        raise RuntimeError("no cubin")


def main() -> int:
    results = {}
    for case in json.load(sys.stdin):
        module, name = case["kernel"].split(":")
        try:
            compile_for(getattr(importlib.import_module(module), name), case["constexprs"], case["pointers"],
                        case["capability"], case["num_warps"], case["num_stages"])
            results[case["id"]] = "ok"
        except Exception as error:  # noqa: BLE001 - every failure is the case's result
            results[case["id"]] = f"{type(error).__name__}: {error}"[:2000]
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
