"""Minimal Gluon kernel for a ptxas scheduling question, compiled for sm90 without a GPU: one
warp group issues S = Q K^T and O += P V asynchronously, waits for S (wgmma.wait_group 1), runs
the softmax of S, then waits for P V (wait_group 0): FA3's intra-warp-group overlap, the shape of
templates/sm90/attn_fwd.py.jinja's key loop. The PTX keeps that order; the script prints how many
of the softmax's MUFU.EX2 the SASS puts before the P V wait (WARPGROUP.DEPBAR.LE gsb0, 0x0).

    python benchmarks/gluon/wait_order.py [--reductions 0|1]

Triton 3.6 (its ptxas, 2026-11-25): with the row max and sum, 0 of 66 before the wait; without
them (exp2 only), 18 of 64. A wait predicated on a softmax result made ptxas serialise every
wgmma instead. benchmarks/gluon/NOTES.md has the context."""
import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait
from triton.runtime.jit import create_function_from_signature


@gluon.jit
def key_loop(Y, N, REDUCTIONS: gl.constexpr):
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    row: gl.constexpr = gl.SliceLayout(1, acc)
    q = gl.allocate_shared_memory(gl.bfloat16, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16))
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16)
    k = gl.allocate_shared_memory(gl.bfloat16, [128, 128], kv_layout)
    v = gl.allocate_shared_memory(gl.bfloat16, [128, 128], kv_layout)
    o = gl.zeros([64, 128], gl.float32, acc)
    p = gl.zeros([64, 128], gl.bfloat16, p_layout)
    m = gl.full([64], -1e30, gl.float32, row)
    l = gl.zeros([64], gl.float32, row)
    for _ in range(N):
        s_tok = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([64, 128], gl.float32, acc), use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p, v, o, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        if REDUCTIONS:
            m_new = gl.maximum(m, gl.max(s, axis=1))
            probs = gl.exp2(s - gl.expand_dims(m_new, 1))
            alpha = gl.exp2(m - m_new)
            l = l * alpha + gl.sum(probs, axis=1)
            m = m_new
        else:
            probs = gl.exp2(s)
            alpha = m
        o, p, probs, alpha = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p, probs, alpha))
        o = o * gl.expand_dims(alpha, 1)
        p = gl.convert_layout(probs.to(gl.bfloat16), p_layout)
    rows = gl.expand_dims(gl.arange(0, 64, layout=row), 1)
    cols = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, acc)), 0)
    gl.store(Y + rows * 128 + cols, o / gl.expand_dims(l + 1.0, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reductions", type=int, default=1)
    args = parser.parse_args()
    backend = make_backend(GPUTarget("cuda", 90, 128))
    call, kwargs = [torch.zeros(64, 128), 10], dict(REDUCTIONS=bool(args.reductions), num_warps=4)
    bound, spec, options = create_function_from_signature(key_loop.signature, key_loop.params, backend)(*call, **kwargs)
    options, signature, constexprs, attrs = key_loop._pack_args(backend, kwargs, bound, spec, options)
    compiled = triton.compile(GluonASTSource(key_loop, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 128),
                              options=options.__dict__)
    path = os.path.join(tempfile.mkdtemp(), "wait_order.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,5}\*/\s+(.*?);", sass)
    wait = next(i for i, op in enumerate(ops) if "DEPBAR.LE gsb0, 0x0" in op and i > 0
                and any("MUFU.EX2" in x for x in ops[i:]))
    start = max(i for i in range(wait) if "DEPBAR.LE gsb0, 0x1" in ops[i])
    before = sum("MUFU.EX2" in op for op in ops[start:wait])
    total = before + sum("MUFU.EX2" in op for op in ops[wait:wait + 400] if "HGMMA" not in op)
    ptx_order = compiled.asm["ptx"].split("wgmma.wait_group.sync.aligned 1")[1].split("wgmma.wait_group.sync.aligned 0")[0]
    print(f"triton {triton.__version__}: PTX has {ptx_order.count('ex2.approx')} ex2 between the waits; "
          f"SASS has {before} of {total} MUFU.EX2 before the P V wait")


if __name__ == "__main__":
    main()
