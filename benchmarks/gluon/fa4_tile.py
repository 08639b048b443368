"""Is FA4's 80-query backward tile (head dim 128, no mask) what separates its backward from ours?
FA4's backward (flash_attn.cute, its sm90 kernel) timed with its own tile (80 queries, dQ swapped),
forced to 64 queries (ours) and to 64 with dQ swapped, attncc's beside it, in turn, full attention,
bf16; gradients compared with the 80-query run's. Needs flash-attn-4 (../shared/tools/fa4-wheels.sh).

    python benchmarks/gluon/fa4_tile.py [ROUNDS]

H200, 2026-11-29: the three FA4 forms within 1 % of each other (benchmarks/gluon/NOTES.md)."""
import dataclasses
import sys

import torch
from triton.testing import do_bench

import flash_attn.cute.interface as I
from flash_attn.cute import flash_attn_func
import attncc

orig = I._tile_size_bwd_sm90
FORCE = {"m": None, "swap": None}


def patched(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
    cfg = orig(head_dim, head_dim_v, causal, local, sparse_block_size_q)
    if FORCE["m"] is not None:
        cfg = dataclasses.replace(cfg, m_block_size=FORCE["m"], dQ_swapAB=FORCE["swap"])
    return cfg


I._tile_size_bwd_sm90 = patched
kernel = attncc.compile(attncc.Variant())
shapes = [(4, 16, 4096, 128), (1, 16, 16384, 128), (16, 16, 1024, 128)]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
res = {}
for B, H, N, D in shapes:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn_like(q)
    grads = {}
    fns = {}
    for name, m, swap in (("fa4-80", None, None), ("fa4-64", 64, False), ("fa4-64s", 64, True)):
        def fn(q, k, v, m=m, swap=swap):
            FORCE.update(m=m, swap=swap)
            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        fns[name] = fn
    fns["attncc"] = lambda q, k, v: kernel(q, k, v)
    for name, fn in fns.items():
        try:
            out = fn(q, k, v)
            grads[name] = torch.autograd.grad(out, (q, k, v), go, retain_graph=True)
        except Exception as e:  # noqa: BLE001
            print(name, (B, H, N, D), "failed:", repr(e)[:300])
            fns[name] = None
    ref = grads.get("fa4-80")
    for name, g in grads.items():
        err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(g, ref))
        print(f"{name} {B}x{H}x{N}x{D} rel err vs fa4-80 {err:.2e}")
    for r in range(rounds):
        for name, fn in fns.items():
            if fn is None:
                continue
            out = fn(q, k, v)
            ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), go, retain_graph=True), warmup=25, rep=100,
                          return_mode="median")
            res.setdefault((B, H, N, D, name), []).append(ms)
            del out
print("| shape | " + " | ".join(["fa4-80", "fa4-64", "fa4-64s", "attncc"]) + " |")
for B, H, N, D in shapes:
    cells = []
    for name in ("fa4-80", "fa4-64", "fa4-64s", "attncc"):
        v = res.get((B, H, N, D, name))
        cells.append(" / ".join(f"{x:.3f}" for x in v) if v else "-")
    print(f"| {B}x{H}x{N}x{D} | " + " | ".join(cells) + " |")
