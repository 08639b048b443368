"""The Gluon backward's gradients against float64, per probe patch, beside the Triton tier's:
mean |g - ref| / mean |ref| over dq, dk, dv (the largest of the three), and the same with max.
gluon_bwd_probe.py's error column compares with the Triton tier's bf16 gradients, where one
rounding flip decides the max; this compares with the truth.

    python benchmarks/gluon/bwd_accuracy.py [--shapes 1x4x4096x128,...] [--only full,causal]
        [--patches base,no-fold,@DIR]
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gluon_bwd_probe import patched_backward, render  # noqa: E402 - beside this file
from variants import make_cases  # noqa: E402


def errors(grads, ref):
    """(mean-relative, max-relative) error, the largest over the gradients."""
    pairs = [(g.double() - r, r) for g, r in zip(grads, ref)]
    return (max((d.abs().mean() / r.abs().mean()).item() for d, r in pairs),
            max((d.abs().max() / r.abs().max()).item() for d, r in pairs))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x4x4096x128,1x4x4096x64,2x4x1000x128")
    p.add_argument("--only", default="full,causal,softcap_causal,gqa4_causal")
    p.add_argument("--patches", default="base,no-fold")
    args = p.parse_args()
    os.environ["ATTNCC_TIER"] = "triton"  # the autograd path below; the patched kernels launch directly
    import attncc
    from attncc import reference
    patches = args.patches.split(",")
    folder = tempfile.mkdtemp()
    print("mean-relative / max-relative error against float64\n")
    print("| variant | shape | triton tier | " + " | ".join(patches) + " |")
    print("|---|---|--:|" + "--:|" * len(patches))
    for shape in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        B, H, N, D = shape
        cases = make_cases(H, N, "cuda")
        for name in args.only.split(","):
            case = cases[name]
            gqa = case.gqa > 1
            g = torch.Generator(device="cuda").manual_seed(1)
            q, k, v = (2 * torch.randn(B, h, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
                       for h in (H, H // case.gqa, H // case.gqa))
            do = torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
            qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
            od = reference.attention(qd, kd, vd, case.score_mod, case.mask_mod, enable_gqa=gqa)
            ref = torch.autograd.grad(od, (qd, kd, vd), do.double())
            out, lse = attncc.attention(q, k, v, case.score_mod, case.mask_mod, enable_gqa=gqa, return_lse=True)
            qt, kt, vt = (x.detach().requires_grad_() for x in (q, k, v))
            o2 = attncc.attention(qt, kt, vt, case.score_mod, case.mask_mod, enable_gqa=gqa)
            results = {"triton": torch.autograd.grad(o2, (qt, kt, vt), do)}
            variant, _ = render(case, D, case.gqa)
            for patch in patches:  # each launched once, when compiled
                results[patch] = patched_backward(name, case, variant, patch, q, k, v, out, lse, do, folder)[1]
            cells = [errors(results[key], ref) for key in ["triton"] + patches]
            print(f"| {name} | {B}x{H}x{N}x{D} | " + " | ".join(f"{m:.2e} / {x:.2e}" for m, x in cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
