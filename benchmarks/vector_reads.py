"""What a vector read costs per score on the GPU (issue 32, item 3): causal attention with a
score_mod that reads rows of captured tensors, `torch.dot(q_rope[q_idx], k_rope[kv_idx])` and a
learned distance `(a[q_idx] - b[kv_idx]).pow(2).sum(-1).sqrt()`, at several row lengths, against
plain causal attention in the same run: nanoseconds per unmasked score added, forward and
forward+backward, bf16, do_bench medians. Every case runs on the Triton tier (ATTNCC_TIER=triton
unless --tier says otherwise), so that the baseline differs from the others only in the mod. A dot
of a query's row with a key's row is one tile product per tile (attncc.passes.rowdots);
--unrolled keeps the R products per score instead, for the comparison (run it as a second process).

    python benchmarks/vector_reads.py [--shape BxHxNxD] [--unrolled] [--tier auto]
"""
import argparse
import os

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="4x16x4096x128")
    p.add_argument("--unrolled", action="store_true", help="R products per score, not the tile product")
    p.add_argument("--tier", default="triton", help="ATTNCC_TIER for every case")
    args = p.parse_args()
    os.environ["ATTNCC_TIER"] = args.tier
    if args.unrolled:  # kernel files are cached by variant and spec, not by text: a cache of their own
        import tempfile
        os.environ["ATTNCC_CACHE_DIR"] = tempfile.mkdtemp(prefix="attncc-unrolled-")
        from attncc.passes import rowdots
        rowdots.ROW_DOT_MIN = 1 << 30
    B, H, N, D = (int(x) for x in args.shape.split("x"))
    import attncc
    from triton.testing import do_bench
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    cases = {"causal (baseline)": None}
    for r in (4, 16, 64):
        for dtype in (torch.bfloat16, torch.float32):
            q_rope = (0.1 * torch.randn(N, r, generator=g, device="cuda")).to(dtype)
            k_rope = (0.1 * torch.randn(N, r, generator=g, device="cuda")).to(dtype)
            cases[f"dot of {str(dtype)[6:]} rows, r={r}"] = (
                lambda qr, kr: lambda s, b, h, q_idx, kv_idx: s + torch.dot(qr[q_idx], kr[kv_idx]))(q_rope, k_rope)
    for r in (8, 32):
        a = torch.randn(N, r, generator=g, device="cuda")
        bb = torch.randn(N, r, generator=g, device="cuda")
        cases[f"distance of rows, r={r}"] = (lambda a_, b_: lambda s, b, h, q_idx, kv_idx: s - 0.1 * (
            a_[q_idx] - b_[kv_idx]).pow(2).sum(-1).sqrt())(a, bb)
    scores = B * H * N * (N + 1) / 2  # unmasked scores of causal attention
    rows, base = [], None
    for name, score_mod in cases.items():
        kernel = attncc.compile(attncc.Variant(score_mod, causal))
        out = kernel(q, k, v)
        do = torch.randn_like(out)
        fwd = do_bench(lambda: kernel(q, k, v), warmup=25, rep=100, return_mode="median")
        both = do_bench(lambda: torch.autograd.grad(kernel(q, k, v), (q, k, v), do), warmup=25, rep=100,
                        return_mode="median")
        if base is None:
            base = (fwd, both)
        rows.append((name, fwd, both, (fwd - base[0]) * 1e6 / scores, (both - base[1]) * 1e6 / scores))
        print(rows[-1], flush=True)
    form = "unrolled products" if args.unrolled else "tile products"
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {args.shape}, causal, "
          f"ATTNCC_TIER={args.tier}, row dots as {form}\n")
    print("| score_mod | fwd ms | fwd+bwd ms | fwd ns / score added | fwd+bwd ns / score added |")
    print("|---|--:|--:|--:|--:|")
    for name, fwd, both, nf, nb in rows:
        print(f"| {name} | {fwd:.3f} | {both:.3f} | {nf:.4f} | {nb:.4f} |")


if __name__ == "__main__":
    main()
