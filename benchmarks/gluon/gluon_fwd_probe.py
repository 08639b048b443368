"""Probe the Gluon forward (templates/sm90/attn_fwd.py.jinja) on a Hopper GPU: render it for a
variant, apply text patches of its launcher's knobs, and time each patched kernel against the
unpatched one and the Triton tier's forward in one process (do_bench medians, bf16 or --dtype), with the
largest error of each output against the Triton tier's.

    python benchmarks/gluon/gluon_fwd_probe.py [--shapes BxHxNxD,...] [--only full,causal] [--patches base,rescale-early,@DIR]
        [--peer fa4] [--rep MS] [--rounds R] [--dtype float16]

The kernel is what the plan renders for the variant (three consumer warp groups where
tiles.wide_forward grants them). Patches: fwd_patches.py's text edits (benchmarks/gluon/NOTES.md),
probe_common.py's plan patches (`wide` / `narrow`: three / two consumer warp groups at head dim
64), @DIR, the kernel rendered from another templates/ folder (as in gluon_bwd_probe.py),
ptxas=PATH, the kernel compiled by another ptxas (probe_common.compiler), and ptxopt=A:B, with
ptxas options "A B" (probe_common.ptx_options).
"""
import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fwd_patches import OPTIONAL, PATCHES  # noqa: E402 - beside this file
from probe_common import apply, build_plan, compiler, peer_fn, print_table, sparse_lists, time_cell  # noqa: E402
from variants import make_cases  # noqa: E402

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4x32x4096x64,1x32x16384x64")
    p.add_argument("--only", default="full,causal,sliding_window_1024")
    p.add_argument("--patches", default="base")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--peer", default="", help="also time one of bench.py's systems in turn (fa4, flex-flash)")
    p.add_argument("--rep", type=int, default=200, help="do_bench time of a kernel per round, ms (four measurements of rep / 4)")
    p.add_argument("--rounds", type=int, default=1, help="measure the kernels of a cell in turn this many times, "
                   "in order and in reverse (probe_common.time_cell), and keep each one's median")
    args = p.parse_args()
    # the Triton tier is the baseline, timed in turn with the patched kernels (launched directly)
    os.environ["ATTNCC_TIER"] = "triton"
    import attncc
    from attncc import codegen, runtime
    from attncc.spec import Spec
    folder, rows = tempfile.mkdtemp(), []
    patches = args.patches.split(",")
    for shape in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        B, H, N, D = shape
        cases = make_cases(H, N, "cuda")
        for name in args.only.split(","):
            case = cases[name]
            variant = attncc.Variant(case.score_mod, case.mask_mod)
            spec = Spec(args.dtype, D, D, case.gqa, "cuda-sm90", tier="gluon")
            g = torch.Generator(device="cuda").manual_seed(0)
            dtype = getattr(torch, args.dtype)
            q = torch.randn(B, H, N, D, generator=g, device="cuda", dtype=dtype)
            k, v = (torch.randn(B, H // case.gqa, N, D, generator=g, device="cuda", dtype=dtype) for _ in range(2))
            caps = [c.tensor for c in variant.captures]
            kernel = attncc.compile(variant)
            want = kernel(q, k, v, enable_gqa=case.gqa > 1)
            fns = {"triton": lambda: kernel(q, k, v, enable_gqa=case.gqa > 1)}
            errors = {}
            for patch in patches:
                if patch.startswith("@"):  # another checkout's templates
                    src = codegen.render(build_plan("fwd", variant, spec), patch[1:])
                else:
                    text = codegen.render(build_plan("fwd", variant, spec, patch))
                    # the render may have set the flag, and rounds P one way or the other (plan.probs_in_pairs)
                    src = apply(text, patch, PATCHES, optional=OPTIONAL)
                tag = re.sub(r"\W", "_", patch)  # a module name per source
                path = Path(folder) / f"fwd_{name}_{tag}_d{D}_g{case.gqa}_{N}.py"
                path.write_text(src)
                module = runtime.load(path, False, src)
                out = torch.full_like(q, float("nan"))
                lse = torch.empty(B, H, N, device="cuda")
                lists = sparse_lists(module, variant, spec, caps, B, H, N, q.device)
                def fn(m=module, o=out, l=lse, b=lists):  # noqa: E741
                    m.launch(q, k, v, o, l, caps, D ** -0.5, blocks=b)
                fns[patch] = fn
                with compiler(patch):  # compiles it
                    fn()
                err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
                errors[patch] = float("nan") if err != err else err
            peer = peer_fn(args.peer, case, N) if args.peer else None
            if peer is not None:
                # inputs that require grad, as bench.py times every forward (training). Without them
                # FA4's causal 4x16x4096x128 forward measured 0.488 ms here against 0.433 in bench.py
                # (H200, 2026-11-28, one session), the cause not yet measured
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                fns[args.peer] = lambda f=peer: f(qg, kg, vg)  # noqa: E731
                out = fns[args.peer]().detach()
                errors[args.peer] = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
            tri, times = time_cell(f"{name} {shape}", fns, errors, args.rounds, args.rep)
            rows.append((name, "x".join(map(str, shape)), tri, times, errors))
    print_table(rows, patches + ([args.peer] if args.peer else []), "forward")


if __name__ == "__main__":
    main()
