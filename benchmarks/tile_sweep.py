"""Sweep tile shapes / warps / stages of the generated kernels on the GPU (one subprocess per
configuration, since ATTNCC_TILES is read when a kernel is generated). Prints a table; the best
configurations become the defaults in attncc/plan.py:choose_tiles."""
import json
import os
import subprocess
import sys

CHILD = r"""
import json, torch, triton, attncc
res = {}
for (B, H, N, D) in [(4, 16, 4096, 128), (4, 32, 4096, 64)]:
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    for name, mm in (("full", None), ("causal", lambda b, h, qi, ki: qi >= ki)):
        kern = attncc.compile(attncc.Variant(mask_mod=mm))
        f = triton.testing.do_bench(lambda: kern(q, k, v), warmup=25, rep=80, return_mode="median")
        fb = triton.testing.do_bench(lambda: kern(q, k, v).backward(do), warmup=25, rep=80, return_mode="median")
        res[f"{name} D={D}"] = (round(f, 3), round(fb - f, 3))
print("RESULT " + json.dumps(res))
"""

FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
DKDV = [(32, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (128, 128, 8, 2)]
DQ = [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2)]


def run(overrides):
    env = dict(os.environ, ATTNCC_TILES=json.dumps(overrides))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": out.stderr[-300:]}


rows = []
for c in FWD:
    rows.append(("attn_fwd", c, run({"attn_fwd": c})))
for c in DKDV:
    rows.append(("attn_bwd_dkdv", c, run({"attn_bwd_dkdv": c})))
for c in DQ:
    rows.append(("attn_bwd_dq", c, run({"attn_bwd_dq": c})))
keys = sorted({k for _, _, r in rows for k in r if k != "error"})
print("| kernel | (BM, BN, warps, stages) | " + " | ".join(f"{k} fwd / bwd ms" for k in keys) + " |")
print("|---|---|" + "---|" * len(keys))
for fn, c, r in rows:
    cells = [("%.3f / %.3f" % tuple(r[k])) if k in r else r.get("error", "?")[:40] for k in keys]
    print(f"| {fn} | {c} | " + " | ".join(cells) + " |")
