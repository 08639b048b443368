"""One decode attention call through attncc's transformers entry against SDPA: GPU time per
call (do_bench median: back-to-back calls, so a host-bound call shows its host time) and host
time per call (wall time of the Python with the GPU running behind), for Llama-3-8B's heads
(32 query heads, 8 K/V heads, head dim 128), one query at the end of L keys, bf16. Issue 33's
decode gap: the call is host-bound where SDPA's kernel is shorter than attncc's host path.

    python benchmarks/hf_decode.py [--batch 16] [--lens 2049,8193] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lens", default="2049,8193")
    p.add_argument("--profile", action="store_true", help="cProfile 300 calls at the first length")
    args = p.parse_args()
    from triton.testing import do_bench

    from attncc.integrations.transformers import attention_forward
    B, Hq, Hkv, D = args.batch, 32, 8, 128
    layer = SimpleNamespace(is_causal=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B={B}, {Hq}/{Hkv} heads, D={D}, bf16")
    print("| keys | attncc us/call | host us/call | SDPA us/call | attncc K/V read TB/s |")
    print("|--:|--:|--:|--:|--:|")
    for L in (int(x) for x in args.lens.split(",")):
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ours = lambda: attention_forward(layer, q, k, v, None, scaling=D ** -0.5)  # noqa: E731
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        t_ours = do_bench(ours, warmup=25, rep=200, return_mode="median") * 1e3
        t_sdpa = do_bench(sdpa, warmup=25, rep=200, return_mode="median") * 1e3
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            ours()
        host = (time.perf_counter() - start) / 200 * 1e6
        torch.cuda.synchronize()
        tbs = 2 * B * Hkv * L * D * 2 / t_ours / 1e6
        print(f"| {L} | {t_ours:.1f} | {host:.1f} | {t_sdpa:.1f} | {tbs:.2f} |")
        if args.profile:
            args.profile = False
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                ours()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
            print(out.getvalue())


if __name__ == "__main__":
    main()
