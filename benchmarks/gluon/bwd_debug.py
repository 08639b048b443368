"""Where a Gluon backward's gradients differ from float64 autograd: per tensor, the worst rows."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import os
os.environ["ATTNCC_TIER"] = "gluon"
import attncc  # noqa: E402
from variants import BUILDERS  # noqa: E402

for name, (B, H, Lq, Lkv, D) in [("causal", (2, 2, 1, 777, 128)), ("causal", (1, 1, 1, 200, 128)),
                                 ("causal", (1, 1, 2, 200, 128)), ("full", (1, 1, 1, 200, 128))]:
    torch.manual_seed(0)
    sm, mm = BUILDERS[name](B, H, Lq, Lkv, "cuda")
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, H, Lkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, H, Lkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = attncc.attention(q, k, v, sm, mm)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attncc.reference.attention(qd, kd, vd, sm, mm), (qd, kd, vd), do.double())
    for label, gg, w in zip(("dq", "dk", "dv"), got, want):
        err = (gg.double() - w).abs().amax(-1)  # per row
        bad = (err > 0.05 * w.abs().amax().clamp_min(1e-6)).nonzero().tolist()[:6]
        print(name, (B, H, Lq, Lkv), label, f"max abs err {err.max().item():.3g}", "bad rows", bad,
              "got", gg.double().abs().amax().item(), "want", w.abs().amax().item())
