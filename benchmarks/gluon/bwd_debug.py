"""Gluon against Triton backward against float64 autograd: per gradient, the error of each tier
and the worst rows of the Gluon one (a debugging aid for templates/sm90/attn_bwd.py.jinja)."""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import attncc  # noqa: E402
from variants import BUILDERS  # noqa: E402

CASES = [("full", (2, 3, 17, 17, 128)), ("full", (1, 1, 64, 64, 128)), ("full", (1, 1, 128, 128, 128)),
         ("full", (1, 2, 1000, 1000, 128)), ("causal", (1, 2, 1000, 1000, 128)), ("full", (1, 1, 17, 200, 128))]
for name, (B, H, Lq, Lkv, D) in CASES:
    torch.manual_seed(0)
    sm, mm = BUILDERS[name](B, H, Lq, Lkv, "cuda")
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, H, Lkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, H, Lkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = {}
    for tier in ("gluon", "triton"):
        os.environ["ATTNCC_TIER"] = tier
        out = attncc.attention(q, k, v, sm, mm)
        do = torch.ones_like(out)
        got[tier] = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attncc.reference.attention(qd, kd, vd, sm, mm), (qd, kd, vd), do.double())
    for i, label in enumerate(("dq", "dk", "dv")):
        w = want[i]
        eg, et = ((got[t][i].double() - w).norm().item() for t in ("gluon", "triton"))
        rows = (got["gluon"][i].double() - w).abs().amax(-1)
        bad = (rows > 4 * (got["triton"][i].double() - w).abs().amax(-1) + 1e-2).nonzero().tolist()[:5]
        print(f"{name} {(B, H, Lq, Lkv)} {label}: |ref| {w.norm().item():.3g} gluon err {eg:.3g} triton err {et:.3g} "
              f"bad rows {bad}", flush=True)
