"""Where the backward's time goes: the one attn_bwd launch timed whole, with only its dK/dV
programs and with only its dQ programs, next to compiled FlexAttention's backward, plus the
kernel's registers and spills. A diagnostic for tuning attn_bwd.py.jinja (H100/H200).

    python benchmarks/bwd_probe.py [--only causal,gqa4_causal] [--shapes 16x16x1024x128,1x16x16384x128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from variants import make_cases  # noqa: E402


class Part:
    """Stands in for a module's attn_bwd: launches only one kind of its programs."""

    def __init__(self, kernel, part):
        self.kernel, self.part = getattr(kernel, "fn", kernel), part  # the JITFunction a Launcher wraps

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            args = list(args)
            i, n_kv = (self.kernel.arg_names.index(name) for name in ("BH_KV", "N_CTX_KV"))
            n_dkdv = -(-args[n_kv] // kwargs["BLOCK_N1"]) * args[i]  # cdiv(N_CTX_KV, BLOCK_N1) * BH_KV
            if self.part == "dkdv":
                return self.kernel[(n_dkdv,)](*args, **kwargs)
            args[i] = 0  # no dK/dV programs: every program is a dQ one
            return self.kernel[(grid[0] - n_dkdv,)](*args, **kwargs)
        return launch


def registers(kernel) -> str:
    """n_regs / n_spills of the compiled attn_bwd (best effort across Triton versions)."""
    kernel = getattr(kernel, "fn", kernel)  # an attncc.launcher.Launcher wraps the JITFunction
    for caches in (getattr(kernel, "device_caches", None), getattr(kernel, "cache", None)):
        for entry in (caches or {}).values():
            compiled = entry[0] if isinstance(entry, tuple) else entry
            for k in compiled.values():
                return f"{getattr(k, 'n_regs', '?')} regs, {getattr(k, 'n_spills', '?')} spills"
    return "?"


def probe(case, shape, warmup, rep, flex=True):
    import attncc
    from attncc import autograd
    B, H, N, D = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda h: torch.randn(B, h, N, D, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, dout = rand(H), rand(H // case.gqa), rand(H // case.gqa), rand(H)
    kernel = attncc.compile(attncc.Variant(case.score_mod, case.mask_mod))
    rng = torch.tensor([1234, 0]) if case.dropout_p else None  # (seed, offset) as autograd saves them
    launch = autograd._launch(kernel, q, k, v, rng, None, case.dropout_p, False)
    captures = [c.tensor for c in kernel.variant.captures]  # document ids, slopes, bias tables
    out, lse = autograd.run_forward(launch, q, k, v, captures)
    module = kernel.module("bwd", kernel.bwd_spec(launch.spec, (), False))
    blocks = launch.blocks(module, q, k, captures)  # tile classes of a data-dependent mask
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    run = lambda: module.launch(q, k, v, out, lse, dout, None, dq, dk, dv, captures, [], launch.scale,  # noqa: E731
                                *launch.rng, blocks=blocks)
    whole = module.attn_bwd
    res = {"all": bench.bench_ms(run, warmup, rep)}
    for part in ("dkdv", "dq"):
        module.attn_bwd = Part(whole, part)
        try:
            res[part] = bench.bench_ms(run, warmup, rep)
        finally:
            module.attn_bwd = whole
    flex = bench.build("flex", case, N) if flex else None  # None for dropout
    if flex is not None:
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        fwd, fwdbwd = bench.time_fwd_bwd(flex, qf, kf, vf, [qf, kf, vf], dout, warmup, rep)
        res["flex"] = fwdbwd - fwd
    return res, registers(whole)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="causal,gqa4_causal")
    p.add_argument("--shapes", default="16x16x1024x128,4x16x4096x128,1x16x16384x128")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes most of the time)")
    a = p.parse_args()
    print("| variant | shape | attn_bwd ms | dK/dV only | dQ only | Flex bwd ms | attncc/Flex | registers |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]:
        cases = make_cases(shape[1], shape[2], "cuda")
        for name in a.only.split(","):
            r, regs = probe(cases[name], shape, a.warmup, a.rep, not a.no_flex)
            flex = f"{r['flex']:.3f} | {r['flex'] / r['all']:.2f}x" if "flex" in r else "n/a | n/a"
            print(f"| {name} | {'x'.join(map(str, shape))} | {r['all']:.3f} | {r['dkdv']:.3f} | {r['dq']:.3f} | "
                  f"{flex} | {regs} |", flush=True)


if __name__ == "__main__":
    main()
