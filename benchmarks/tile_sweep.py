"""Sweep tile shapes / warps / stages of the generated kernels on the GPU (one subprocess per
configuration, since ATTNCC_TILES is read when a kernel is generated). Prints a table; the best
configurations become the defaults in attncc/tiles.py:choose_tiles.

    python benchmarks/tile_sweep.py [--variants full,causal] [--shapes 4x16x4096x128,4x32x4096x64]
                                    [--kernels attn_fwd,attn_bwd_dkdv,attn_bwd_dq]
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, torch, triton, attncc
variants, shapes, backward = json.loads(sys.argv[1])
W = 1024
slopes = {}
def mods(name, H):
    s = slopes.setdefault(H, torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], device="cuda"))
    causal = lambda b, h, q, k: q >= k
    return {"full": (None, None), "causal": (None, causal),
            "sliding": (None, lambda b, h, q, k: (q >= k) & (q - k < W)),
            "alibi": (lambda sc, b, h, q, k: sc + s[h] * (k - q), causal),
            "prefix": (None, lambda b, h, q, k: (k < W) | (q >= k))}[name]
res = {}
for (B, H, N, D) in shapes:
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    for name in variants:
        kern = attncc.compile(attncc.Variant(*mods(name, H)))
        f = triton.testing.do_bench(lambda: kern(q, k, v), warmup=25, rep=80, return_mode="median")
        fb = triton.testing.do_bench(lambda: kern(q, k, v).backward(do), warmup=25, rep=80,
                                     return_mode="median") if backward else f
        res[f"{name} {B}x{H}x{N}x{D}"] = (round(f, 3), round(fb - f, 3))
print("RESULT " + json.dumps(res))
"""

CONFIGS = {
    "attn_fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                 (64, 128, 4, 3), (128, 64, 8, 4), (128, 32, 4, 3)],
    "attn_bwd_dkdv": [(32, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3),
                      (128, 128, 8, 2)],
    # the backward is one launch with attn_bwd_dkdv's warps and stages: dQ sweeps its tile shape
    "attn_bwd_dq": [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 8, 3), (64, 128, 8, 3)],
}


def run(overrides, variants, shapes, backward):
    env = dict(os.environ, ATTNCC_TILES=json.dumps(overrides))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps([variants, shapes, backward])], env=env,
                         capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": out.stderr[-300:]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="full,causal", help="of full, causal, sliding, alibi, prefix")
    p.add_argument("--shapes", default="4x16x4096x128,4x32x4096x64")
    p.add_argument("--kernels", default=",".join(CONFIGS))
    args = p.parse_args()
    variants = args.variants.split(",")
    shapes = [list(map(int, s.split("x"))) for s in args.shapes.split(",")]
    kernels = args.kernels.split(",")
    backward = any(k != "attn_fwd" for k in kernels)
    rows = [(fn, c, run({fn: c}, variants, shapes, backward)) for fn in kernels for c in CONFIGS[fn]]
    keys = sorted({k for _, _, r in rows for k in r if k != "error"})
    print("| kernel | (BM, BN, warps, stages) | " + " | ".join(f"{k} fwd / bwd ms" for k in keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for fn, c, r in rows:
        cells = [("%.3f / %.3f" % tuple(r[k])) if k in r else r.get("error", "?")[:40] for k in keys]
        print(f"| {fn} | {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
