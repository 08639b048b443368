"""Compile the Gluon kernel for sm90 on a machine without a GPU (no launch).

    PYTHONPATH=/tmp/tri36 python benchmarks/gluon/compile_sm90.py [--dump DIR]

Binds the arguments the way JITFunction.run does (CPU tensors are enough for the tensor
descriptors), then calls triton.compile with GPUTarget("cuda", 90, 128), which runs the whole
pipeline down to ptxas (shipped in the triton wheel) and so catches API, layout and
register-allocation errors. Prints registers / spills / shared memory per configuration.
"""
import argparse
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fwd_sm90  # noqa: E402

TARGET = GPUTarget("cuda", 90, 128)


def compile_cpu(kernel, args, kwargs):
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    src = GluonASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def resource_usage(ck):
    """registers / stack / spills from cuobjdump (the metadata fills n_regs only when loaded)."""
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return f"REG={m.group(1)} STACK={m.group(2)} LOCAL={m.group(4)}" if m else out.strip()[-200:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=None)
    a = ap.parse_args()
    print("triton", triton.__version__, triton.__file__)
    cases = []
    for D in (128, 64):
        for causal in (False, True):
            for dt in (torch.bfloat16, torch.float16):
                cases.append((D, causal, dt, {}))
    for cfg in (dict(PINGPONG=0), dict(PINGPONG=2), dict(PERSISTENT=False), dict(BLOCK_N=64, STAGES=4)):
        cases.append((128, True, torch.bfloat16, cfg))
    cases.append((64, False, torch.bfloat16, dict(STAGES=4)))
    cases.append((128, False, torch.bfloat16, dict(FENCE=True, RESCALE_EARLY=True)))
    cases.append((128, True, torch.bfloat16, dict(PERSISTENT=True, HG=4)))
    cases.append((64, False, torch.bfloat16, dict(NUM_WG=3)))
    cases.append((64, True, torch.bfloat16, dict(NUM_WG=3, STAGES=4)))
    cases.append((64, True, torch.bfloat16, dict(NUM_WG=3, PINGPONG=2)))
    ok = True
    for D, causal, dt, cfg in cases:
        q = torch.zeros(2, 2, 1000, D, dtype=dt)
        k = torch.zeros(2, 2, 777, D, dtype=dt)
        grid, args, kwargs, _, _ = fwd_sm90.make_args(q, k, k, causal, None, **cfg)
        tag = f"D={D} causal={causal} {str(dt)[6:]} {cfg}"
        try:
            ck = compile_cpu(fwd_sm90.attn_fwd_sm90_kernel, args, kwargs)
        except Exception as e:  # noqa: BLE001
            ok = False
            print("FAIL", tag, type(e).__name__, str(e)[:3000])
            continue
        md = ck.metadata
        ptx = ck.asm["ptx"]
        nreg = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
        print(f"OK   {tag}: shared={md.shared} warps={md.num_warps} setmaxnreg={nreg} {resource_usage(ck)}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            name = f"D{D}_c{int(causal)}_{str(dt)[6:]}" + "".join(f"_{k}{v}" for k, v in cfg.items())
            for ext in ("ttgir", "ptx", "sass"):
                if ext in ck.asm:
                    with open(os.path.join(a.dump, f"{name}.{ext}"), "w") as f:
                        f.write(ck.asm[ext] if isinstance(ck.asm[ext], str) else str(ck.asm[ext]))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
