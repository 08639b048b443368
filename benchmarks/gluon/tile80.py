"""Can Gluon (Triton 3.6) express FA4's head-dim-128 backward tile of 80 queries, and at what
register cost? Compiled for sm90 without a GPU: one consumer warp group's step over 64 keys and
80 queries, each 80-wide product as two (64 + 16 queries: Gluon's tensors have power-of-two
shapes), FA4's order (S^T and dP^T issued, P^T, dS^T, dV and dK from registers, dQ^T swapped so
that its M is half the head dim). Prints registers, spills and the SASS's HGMMA shapes.

    PYTHONPATH=<triton 3.6> python benchmarks/gluon/tile80.py [--queries 80|64] [--tail-first]

Triton 3.6, 240 registers (2026-11-27): 64 queries 56 bytes of stack (as the real kernel at head
dim 128), 80 queries 264 bytes, 176 with the 16 queries' part first. No data moves (shared memory is allocated, never loaded): this is about the code ptxas makes,
not about numbers. benchmarks/gluon/NOTES.md has the context. Since 2026-11-29 moot: FA4's own
backward forced to 64-query tiles is as fast as at 80 (fa4_tile.py), so this tile is not the gap."""
import argparse
import collections
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

D = gl.constexpr(128)  # head dim
KEYS = gl.constexpr(64)  # one warp group's keys


@gluon.constexpr_function
def _acc(n):
    """The wgmma accumulator layout of one warp group, n columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _part(k_rows, v_rows, q, do, lse, delta, dv, dk, N: gl.constexpr):
    """S^T, dP^T, P^T and dS^T of the warp group's keys against N queries; dV and dK updated."""
    s_layout: gl.constexpr = _acc(N)
    acc: gl.constexpr = _acc(128)
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    s_tok = warpgroup_mma(k_rows, q.permute((1, 0)), gl.zeros([64, N], gl.float32, s_layout), use_acc=False,
                          is_async=True)
    dp_tok = warpgroup_mma(v_rows, do.permute((1, 0)), gl.zeros([64, N], gl.float32, s_layout), use_acc=False,
                           is_async=True)
    sT = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    pT = gl.exp2(sT * 0.125 - gl.expand_dims(gl.convert_layout(lse, gl.SliceLayout(0, s_layout)), 0))
    pT_op = gl.convert_layout(pT.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2))
    dv_tok = warpgroup_mma(pT_op, do, dv, is_async=True)
    dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok, ))
    dsT = pT * (dpT - gl.expand_dims(gl.convert_layout(delta, gl.SliceLayout(0, s_layout)), 0))
    dsT16 = dsT.to(gl.bfloat16)
    dk_tok = warpgroup_mma(gl.convert_layout(dsT16, op), q, dk, is_async=True)
    dv, dk, pT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, pT_op))
    return dv, dk, dsT16


@gluon.jit
def step80(Y, N_STEPS, TAIL: gl.constexpr, TAIL_FIRST: gl.constexpr):
    """TAIL: queries past the first 64 (16: the 80-query tile; 0: today's 64), their part of the
    step first where TAIL_FIRST."""
    acc: gl.constexpr = _acc(128)
    sh128: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16)
    k_rows = gl.allocate_shared_memory(gl.bfloat16, [KEYS, D], sh128)
    v_rows = gl.allocate_shared_memory(gl.bfloat16, [KEYS, D], sh128)
    k_all = gl.allocate_shared_memory(gl.bfloat16, [2 * KEYS, D], gl.NVMMASharedLayout.get_default_for([128, D], gl.bfloat16))
    q_a = gl.allocate_shared_memory(gl.bfloat16, [64, D], sh128)
    do_a = gl.allocate_shared_memory(gl.bfloat16, [64, D], sh128)
    ds_a = gl.allocate_shared_memory(gl.bfloat16, [2 * KEYS, 64], gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16))
    if TAIL > 0:
        sh16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TAIL, D], gl.bfloat16)
        q_b = gl.allocate_shared_memory(gl.bfloat16, [TAIL, D], sh16)
        do_b = gl.allocate_shared_memory(gl.bfloat16, [TAIL, D], sh16)
        ds_b = gl.allocate_shared_memory(gl.bfloat16, [2 * KEYS, TAIL],
                                         gl.NVMMASharedLayout.get_default_for([128, TAIL], gl.bfloat16))
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    dv = gl.zeros([KEYS, D], gl.float32, acc)
    dk = gl.zeros([KEYS, D], gl.float32, acc)
    for i in range(N_STEPS):
        if TAIL > 0 and TAIL_FIRST:
            lse_b = gl.load(Y + i * 64 + gl.arange(0, TAIL, layout=vec))
            dv, dk, ds16b = _part(k_rows, v_rows, q_b, do_b, lse_b, lse_b, dv, dk, TAIL)
            ds_b.slice(0, KEYS).store(ds16b)
        lse = gl.load(Y + i * 64 + gl.arange(0, 64, layout=vec))
        dv, dk, ds16 = _part(k_rows, v_rows, q_a, do_a, lse, lse, dv, dk, 64)
        ds_a.slice(0, KEYS).store(ds16)
        if TAIL > 0 and not TAIL_FIRST:
            lse_b = gl.load(Y + i * 64 + gl.arange(0, TAIL, layout=vec))
            dv, dk, ds16b = _part(k_rows, v_rows, q_b, do_b, lse_b, lse_b, dv, dk, TAIL)
            ds_b.slice(0, KEYS).store(ds16b)
        gl.thread_barrier()
        # dQ^T (half the head dim x queries) = K^T (that half x all 128 keys) dS^T (keys x queries)
        kT = k_all.permute((1, 0)).slice(0, 64)
        dq_a = warpgroup_mma(kT, ds_a, gl.zeros([64, 64], gl.float32, _acc(64)), use_acc=False, is_async=True)
        if TAIL > 0:
            dq_b = warpgroup_mma(kT, ds_b, gl.zeros([64, TAIL], gl.float32, _acc(TAIL)), use_acc=False, is_async=True)
            dq_a, dq_b = warpgroup_mma_wait(num_outstanding=0, deps=(dq_a, dq_b))
            gl.store(Y + 4096 + gl.arange(0, TAIL, layout=vec), gl.convert_layout(gl.sum(dq_b, 0), vec))
        else:
            dq_a = warpgroup_mma_wait(num_outstanding=0, deps=(dq_a, ))
        gl.store(Y + 8192 + gl.arange(0, 64, layout=vec), gl.convert_layout(gl.sum(dq_a, 0), vec))
    rows = gl.expand_dims(gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc)), 1)
    cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, acc)), 0)
    gl.store(Y + 16384 + rows * D + cols, dv + dk)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=80, choices=(64, 80))
    parser.add_argument("--maxnreg", type=int, default=240, help="the consumers' registers in the real kernel")
    parser.add_argument("--tail-first", action="store_true", help="the 16 queries' part of the step first")
    args = parser.parse_args()
    target = GPUTarget("cuda", 90, 128)
    backend = make_backend(target)
    call, kwargs = [torch.zeros(32768), 10], dict(TAIL=args.queries - 64, TAIL_FIRST=args.tail_first, num_warps=4,
                                                   maxnreg=args.maxnreg)
    bound, spec, options = create_function_from_signature(step80.signature, step80.params, backend)(*call, **kwargs)
    options, signature, constexprs, attrs = step80._pack_args(backend, kwargs, bound, spec, options)
    compiled = triton.compile(GluonASTSource(step80, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    path = os.path.join(tempfile.mkdtemp(), "tile80.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    hgmma = collections.Counter(m.group(1) for m in re.finditer(r"HGMMA\.(\w+)", sass))
    print(f"triton {triton.__version__}, {args.queries} queries: "
          + " ".join(line.strip() for line in usage.splitlines() if "REG" in line))
    print("HGMMA shapes:", dict(hgmma), "| serialising waits (gsb0, 0x0):", sass.count("gsb0, 0x0"))


if __name__ == "__main__":
    main()
