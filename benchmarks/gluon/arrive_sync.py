"""Minimal Gluon kernel for what an mbarrier hand-over costs a warp group on triton 3.6, compiled
for sm90 without a GPU. One warp group (4 warps), per loop turn: wait until the buffer is free,
store a tile to shared memory, fence it for the async proxy, arrive "written" (the shape of the
backward's dS^T and dQ hand-overs in templates/sm90/attn_bwd.py.jinja). Prints the PTX of one turn's
barrier instructions.

    python benchmarks/gluon/arrive_sync.py [--store 0|1]

Triton 3.6 (2026-11-28), with the store or without it: `bar.sync 0` (the warp group; `bar.sync
id, 128` inside a warp-specialised partition) before the try-wait, and again before the arrive,
which one elected thread makes. So each wait and each arrive synchronises the warp group's four
warps; FA3/FA4 hand over with hardware
named barriers (`bar.arrive` / `bar.sync id, threads`: one instruction a side, the producer warp
included in the count), which Gluon 3.6 has no operation for (inline asm of them made ptxas spill:
benchmarks/gluon/NOTES.md). Two such hand-overs a step are four warp-group barriers in the
backward's loop; ncu puts attncc's largest stall share at CTA barriers where FA4's is at shared-
memory scoreboards."""
import argparse
import os
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_sm90 import compile_cpu  # noqa: E402


@gluon.jit
def hand_over(X, N, STORE: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    buf = gl.allocate_shared_memory(gl.float32, [32, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)
    offs = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(1, layout)), 1) * 16 + \
        gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, layout)), 0)
    x = gl.load(X + offs)
    for i in range(N):
        mbarrier.wait(bars.index(1), (i & 1) ^ 1)  # free: the reader arrived
        if STORE:
            buf.store(x)
            fence_async_shared()
        mbarrier.arrive(bars.index(0), count=1)  # written
        x = x + 1.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", type=int, default=1)
    args = parser.parse_args()
    ptx = compile_cpu(hand_over, [torch.zeros(32, 16), 10], dict(STORE=bool(args.store), num_warps=4)).asm["ptx"]
    start = ptx.rindex("$L__BB0_", 0, ptx.index("mbarrier.try_wait"))  # the loop's label
    wanted = ("bar.sync", "mbarrier.try_wait", "mbarrier.arrive", "fence.proxy", "st.shared", "bra ")
    lines = [line.strip() for line in ptx[start:].splitlines()[1:] if any(w in line for w in wanted)]
    loop = lines[:next(i for i, line in enumerate(lines) if "bra " in line and "waitLoop" not in line) + 1]
    print(f"triton {triton.__version__}, store={bool(args.store)}: one turn's barrier instructions")
    for line in loop:
        print("   ", re.sub(r"\s+", " ", line))
    print(f"warp-group barriers (bar.sync) a turn: {sum('bar.sync' in line for line in loop)}")


if __name__ == "__main__":
    main()
