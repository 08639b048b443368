"""A/B of attncc's two tiers in one process: ATTNCC_TIER=triton against ATTNCC_TIER=gluon
(templates/sm90) on the benchmark variants, bf16, do_bench medians, with the relative difference
of the two results and SDPA cuDNN where it runs the cell. --backward times the backward alone
(autograd.grad of a kept graph) and compares dQ.

    python benchmarks/tier_ab.py [--backward] [--only VARIANT,...] [--shapes BxHxNxD,...]
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import NAMES, density, make_cases  # noqa: E402

SHAPES = ((16, 16, 1024, 128), (4, 16, 4096, 128), (1, 16, 16384, 128), (4, 32, 4096, 64))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=",".join(n for n in NAMES if not n.startswith("dropout")))
    p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    p.add_argument("--backward", action="store_true")
    p.add_argument("--rep", type=int, default=100, help="do_bench time per measurement, ms")
    args = p.parse_args()
    kind = "bwd" if args.backward else "fwd"
    import attncc
    from triton.testing import do_bench
    rows = []
    for shape in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        B, H, N, D = shape
        cases = make_cases(H, N, "cuda")
        for name in args.only.split(","):
            case = cases[name]
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, h, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
                       for h in (H, H // case.gqa, H // case.gqa))
            kernel = attncc.compile(attncc.Variant(case.score_mod, case.mask_mod))
            do = torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16)  # one dO for both tiers
            res = {}
            for tier in ("triton", "gluon"):
                os.environ["ATTNCC_TIER"] = tier
                if args.backward:
                    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
                    out = kernel(q, k, v, enable_gqa=case.gqa > 1)
                    leaves = (q, k, v, *case.learnable)  # learnable captures' gradients too
                    fn = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)[0]  # noqa: E731
                else:
                    fn = lambda: kernel(q, k, v, enable_gqa=case.gqa > 1)  # noqa: E731
                with torch.set_grad_enabled(args.backward):
                    result = fn()
                    ran = [s.tier for (key, kind_, s), _ in attncc.api._loaded.items()
                           if key == kernel.variant.ir_key and kind_ == kind]
                    res[tier] = (do_bench(fn, warmup=25, rep=args.rep, return_mode="median"), result, tier in ran)
            os.environ.pop("ATTNCC_TIER")
            cudnn = None
            if case.sdpa is not None and not case.dropout_p:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    if args.backward:
                        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
                        o = F.scaled_dot_product_attention(qs, ks, vs, **case.sdpa)
                        d = torch.randn_like(o)
                        sfn = lambda: torch.autograd.grad(o, (qs, ks, vs), d, retain_graph=True)  # noqa: E731
                    else:
                        sfn = lambda: F.scaled_dot_product_attention(q, k, v, **case.sdpa)  # noqa: E731
                    try:
                        cudnn = do_bench(sfn, warmup=25, rep=args.rep, return_mode="median")
                    except RuntimeError:
                        cudnn = None
            a, b = res["triton"][1].float(), res["gluon"][1].float()
            diff = ((a - b).norm() / a.norm()).item()
            flops = 4 * B * H * N * N * D * density(case.mask_mod, N, "cuda") * (2.5 if args.backward else 1)
            rows.append((name, "x".join(map(str, shape)), res["triton"][0], res["gluon"][0], res["gluon"][2], cudnn,
                         flops / res["gluon"][0] / 1e9, diff))
            print(rows[-1], flush=True)
    what = "backward (counted as 2.5x the forward's FLOPs)" if args.backward else "forward"
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {what} ms (do_bench median)\n")
    print("| variant | B×H×N×D | triton tier | gluon tier | gluon ran | triton/gluon | cuDNN | gluon TFLOP/s | rel diff |")
    print("|---|---|--:|--:|---|--:|--:|--:|--:|")
    for name, shape, t, gms, ran, cud, tf, diff in rows:
        print(f"| {name} | {shape} | {t:.3f} | {gms:.3f} | {ran} | {t / gms:.2f}x | "
              f"{'' if cud is None else f'{cud:.3f}'} | {tf:.0f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
