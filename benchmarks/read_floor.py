"""How close one decode step can get to the copy bandwidth: a bare Triton kernel that only reads
the K/V bytes of benchmarks/decode.py's B=1 rows (4 K/V heads, head dim 128, bf16) and writes one
float per program, timed from a CUDA graph as decode.py times its steps, next to an empty kernel
and attncc's decode step on the same bytes. Needs a CUDA GPU.

    python benchmarks/read_floor.py [--kv 1024,4096,16384,65536,131072]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402

import attncc  # noqa: E402


@triton.jit
def read_kernel(x_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Sums its CHUNK of x (so that the loads cannot be dropped) and stores one float."""
    base = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, CHUNK, BLOCK, num_stages=4):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1.0)


def fastest_read(kv: torch.Tensor, out: torch.Tensor) -> tuple:
    """(ms, programs, block) of the fastest read over a few grid and block sizes."""
    n, best = kv.numel(), None
    for programs in (132, 264, 528, 1056):
        for block in (1024, 4096):
            chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
            grid = triton.cdiv(n, chunk)
            ms = decode.bench_graph(lambda: read_kernel[(grid,)](kv, out, n, CHUNK=chunk, BLOCK=block))
            if best is None or ms < best[0]:
                best = (ms, grid, block)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv", default="1024,4096,16384,65536,131072", help="key counts (B=1)")
    args = p.parse_args()
    peak = decode.copy_bandwidth()
    out = torch.empty(4096, device="cuda")
    empty = decode.bench_graph(lambda: empty_kernel[(132,)](out))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {peak:.0f} GB/s; empty kernel from a graph {empty * 1e3:.1f} us")
    print("| Lkv | MB | bare read us | % of copy | programs, block | attncc decode us | % of copy |")
    print("|---|---|---|---|---|---|---|")
    compiled = attncc.compile(attncc.Variant())
    for kv_len in (int(x) for x in args.kv.split(",")):
        kv = torch.randn(2 * decode.HKV * kv_len * decode.D, device="cuda", dtype=decode.DTYPE)
        mb = kv.numel() * kv.element_size() / 1e6  # MB per ms is GB/s
        ms, grid, block = fastest_read(kv, out)
        q = torch.randn(1, decode.HQ, 1, decode.D, device="cuda", dtype=decode.DTYPE)
        k, v = (t.view(1, decode.HKV, kv_len, decode.D) for t in kv.view(2, -1))
        step = decode.bench_graph(lambda: compiled(q, k, v, enable_gqa=True))
        print(f"| {kv_len} | {mb:.1f} | {ms * 1e3:.1f} | {mb / ms / peak:.0%} | {grid}, {block} | "
              f"{step * 1e3:.1f} | {mb / step / peak:.0%} |", flush=True)


if __name__ == "__main__":
    main()
