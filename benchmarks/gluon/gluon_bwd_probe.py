"""Probe the Gluon backward (templates/sm90/attn_bwd.py.jinja) on a Hopper GPU: render it for a
variant, apply text patches that switch parts of the schedule off or change its knobs, and time
each patched kernel against the unpatched one and the Triton tier's backward (do_bench medians,
bf16). Patched kernels compute wrong gradients where a patch drops work: they are timings only.

    python benchmarks/gluon/gluon_bwd_probe.py [--shapes BxHxNxD,...] [--only full,causal]
        [--patches base,dq-scale-late,@DIR] [--peer fa4] [--rep MS] [--rounds R]

A patch @DIR renders the kernel from another templates/ folder (an earlier commit's: `git archive
COMMIT templates | tar -x -C DIR`), so that a template change is timed in turn against the kernel
it replaces. The kernels compile with the ptxas attncc.toolchain picks (the newest CUDA toolkit's
where one is newer than Triton's; ATTNCC_PTXAS=triton for Triton's own); a patch ptxas=PATH
compiles the kernel with the ptxas at PATH (Triton 3.6's own: its backends/nvidia/bin/ptxas), a patch
ptxopt=A:B with ptxas options "A B" (e.g. ptxopt=--register-usage-level=0).
"""
import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bwd_patches import PATCHES  # noqa: E402 - beside this file
from probe_common import apply, build_plan, compiler, peer_fn, print_table, sparse_lists, time_cell  # noqa: E402
from variants import make_cases  # noqa: E402


def render(case, D, group, patch="", templates=None):
    import attncc
    from attncc import codegen
    from attncc.spec import Spec
    variant = attncc.Variant(case.score_mod, case.mask_mod)
    spec = Spec("bfloat16", D, D, group, "cuda-sm90", tier="gluon")
    return variant, codegen.render(build_plan("bwd", variant, spec, patch), templates)


def load(text, name, folder):
    from attncc import runtime
    path = Path(folder) / f"bwd_{name}.py"
    path.write_text(text)
    return runtime.load(path, False, text)


def patched_backward(name, case, variant, patch, q, k, v, out, lse, do, folder):
    """The Gluon backward that `patch` makes of the case's rendered source (`@DIR`: another
    checkout's templates), compiled with the patch's ptxas: (fn, grads), fn() filling grads (dq,
    dk, dv; NaN until then)."""
    from attncc.spec import Spec
    B, H, N, D = q.shape
    if patch.startswith("@"):
        src = render(case, D, case.gqa, templates=patch[1:])[1]
    else:
        src = apply(render(case, D, case.gqa, patch)[1], patch, PATCHES)
    tag = re.sub(r"\W", "_", patch)  # a module name per source
    module = load(src, f"{name}_{tag}_g{case.gqa}_{B}x{H}x{N}x{D}", folder)  # a file per shape: mods bake in N
    caps = [c.tensor for c in variant.captures]
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    lists = sparse_lists(module, variant, Spec("bfloat16", D, D, case.gqa, "cuda-sm90"), caps, B, H, N, q.device)

    def fn():
        module.launch(q, k, v, out, lse, do, None, *grads, caps, [], D ** -0.5, blocks=lists)
    with compiler(patch):  # compiles it
        fn()
    return fn, grads


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4x16x4096x128,1x16x16384x128")
    p.add_argument("--only", default="full,causal")
    p.add_argument("--patches", default=",".join(PATCHES))
    p.add_argument("--peer", default="", help="also time one of bench.py's systems in turn (fa4, flex-flash)")
    p.add_argument("--rep", type=int, default=100, help="do_bench time of a kernel per round, ms (four measurements of rep / 4)")
    p.add_argument("--rounds", type=int, default=1, help="measure the kernels of a cell in turn this many times, "
                   "in order and in reverse (probe_common.time_cell), and keep each one's median")
    args = p.parse_args()
    # the Triton tier is the baseline, timed in turn with the patched kernels (launched directly)
    os.environ["ATTNCC_TIER"] = "triton"
    import attncc
    rows = []
    folder = tempfile.mkdtemp()
    for shape in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        B, H, N, D = shape
        cases = make_cases(H, N, "cuda")
        for name in args.only.split(","):
            case = cases[name]
            Hkv = H // case.gqa
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, h, N, D, generator=g, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
            variant, _ = render(case, D, case.gqa)
            out, lse = attncc.attention(q, k, v, case.score_mod, case.mask_mod, enable_gqa=case.gqa > 1, return_lse=True)
            do = torch.randn_like(out)
            qt, kt, vt = (x.detach().requires_grad_() for x in (q, k, v))
            o2 = attncc.attention(qt, kt, vt, case.score_mod, case.mask_mod, enable_gqa=case.gqa > 1)
            want = torch.autograd.grad(o2, (qt, kt, vt), do, retain_graph=True)
            fns = {"triton": lambda: torch.autograd.grad(o2, (qt, kt, vt), do, retain_graph=True)}
            errors = {}
            for patch in args.patches.split(","):
                fns[patch], grads = patched_backward(name, case, variant, patch, q, k, v, out, lse, do, folder)
                # the largest error of dq, dk, dv against the Triton tier's, relative to its largest gradient
                errs = [((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(grads, want)]
                errors[patch] = float("nan") if any(e != e for e in errs) else max(errs)
            peer = peer_fn(args.peer, case, N) if args.peer else None
            if peer is not None:
                qp, kp, vp = (x.detach().requires_grad_() for x in (q, k, v))
                op = peer(qp, kp, vp)
                fns[args.peer] = lambda o=op, ls=(qp, kp, vp): torch.autograd.grad(o, ls, do, retain_graph=True)  # noqa: E731
                errors[args.peer] = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
                                        for g, w in zip(fns[args.peer](), want))
            tri, times = time_cell(f"{name} {shape}", fns, errors, args.rounds, args.rep)
            rows.append((name, "x".join(map(str, shape)), tri, times, errors))
    print_table(rows, args.patches.split(",") + ([args.peer] if args.peer else []), "backward", [
        "Each patch: ms (the largest error of its dq, dk, dv against the Triton tier's, relative; NaN",
        "where it left a gradient unwritten). Patches that drop work are timings only.\n"])


if __name__ == "__main__":
    main()
