"""Host time of attncc's own Python per call, with every kernel launch replaced by a no-op: what
is left is argument checks, the Spec and plan lookups, the tier choice, the autograd.Function or
the torch.library op, the output allocations and the generated module's ``launch`` up to the
``kernel[grid](...)`` call. Runs anywhere (CPU tensors: the interpreter target, whose modules are
loaded but never run); on a GPU it times the CUDA path without launching anything either.

    python benchmarks/host_path.py                    # table of median us per call
    python benchmarks/host_path.py --launcher         # launches through attncc.launcher (see below)
    python benchmarks/host_path.py --stat min         # on a machine other processes share
    python benchmarks/host_path.py --profile "fwd grad" --case alibi   # cProfile of one row

Rows, per case (shape BxHqxLxD, GQA, captured tensor):

    floor fwd / floor step  a bare autograd.Function that allocates the outputs (and the grads):
                            torch's share, which no attention op can avoid
    fwd nograd              kernel(q, k, v) without autograd (inference)
    fwd grad                kernel(q, k, v) recording the autograd node
    step                    out = kernel(q, k, v); out.backward(g): forward + autograd engine +
                            backward (the eager training call)
    op fwd / op bwd         torch.ops.attncc.attention / attention_backward called as the graph
                            torch.compile builds calls them (no autograd: AOTAutograd's graphs)

Each number is the median (``--stat min``: the minimum) over ``--repeats`` batches of ``--calls``
calls, in microseconds.
"""
from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import statistics
import sys
import time
from types import SimpleNamespace

import torch

import attncc
from attncc import launcher, runtime


class NoLaunch:
    """Stands in for a generated module's @triton.jit kernel: ``kernel[grid](*args)`` does nothing."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return _nothing


def _nothing(*args, **kwargs):
    return None


class Compiled:
    """A compiled kernel whose launch does nothing (what attncc.launcher relaunches)."""
    function = packed_metadata = None

    def run(self, *args):
        return None


class JITStandIn:
    """A @triton.jit function as attncc.launcher.Launcher sees it (``params``, ``fn[grid](...)``
    returning the compiled kernel), built from an interpreted kernel's signature: the launcher's
    own host time without a GPU."""

    def __init__(self, interpreted):
        import inspect
        self.params = getattr(interpreted, "params", None)  # a compiled @triton.jit function has them
        if self.params is None:
            free = set(interpreted.kwargs.get("do_not_specialize", ()))
            sig = inspect.signature(interpreted.fn)
            self.params = [SimpleNamespace(name=n, is_constexpr="constexpr" in str(p.annotation),
                                           do_not_specialize=n in free,
                                           default=None if p.default is inspect.Parameter.empty else p.default)
                           for n, p in sig.parameters.items()]
        self.kernel = Compiled()
        self.interpreted = interpreted

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel


def no_launches(through_launcher: bool = False) -> None:
    """Every generated module loaded from now on launches nothing (launcher.wrap is what
    runtime.load calls to wrap a module's HOST_KERNELS); modules loaded already are emptied too.
    ``through_launcher``: the kernels go through attncc.launcher.Launcher (its key, its lookup,
    the compiled kernel's argument list) to a compiled kernel that does nothing; the CUDA device
    and stream it asks Triton's driver for are constants here."""
    def wrap(module, direct=True, interpret=False):
        for name in getattr(module, "HOST_KERNELS", ()):
            fn = getattr(module, name)
            if isinstance(fn, (launcher.Serialised, launcher.Launcher, NoLaunch)):  # a module loaded before
                fn = fn.fn
            if isinstance(fn, JITStandIn):
                fn = fn.interpreted
            if through_launcher:
                lau = launcher.Launcher(JITStandIn(fn))
                lau.device_and_stream = lambda: (0, 0)
                setattr(module, name, lau)
            else:
                setattr(module, name, NoLaunch(fn))
    launcher.wrap = wrap
    for module in runtime._modules.values():
        wrap(module)


def per_call_us(fn, calls: int, repeats: int, stat=statistics.median) -> float:
    """``stat`` (median; min on a busy machine) over ``repeats`` batches of the microseconds
    per call of ``fn``."""
    for _ in range(max(3, calls // 10)):
        fn()
    batches = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - start) / calls * 1e6)
    return stat(batches)


class Floor(torch.autograd.Function):
    """What any attention op costs torch: an autograd node, out and lse, three gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        B, H, L, _ = q.shape
        return torch.empty(B, H, L, v.shape[-1], dtype=q.dtype, device=q.device), \
            torch.empty(B, H, L, dtype=torch.float32, device=q.device)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def cases(device, dtype):
    """name -> (kernel, q, k, v, captures, enable_gqa) on small shapes, where host time dominates."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / 8) for i in range(8)], device=device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def rand(B, H, L, D):
        return torch.randn(B, H, L, D, device=device, dtype=dtype)
    return {
        "causal 4x8x128x64": (attncc.compile(attncc.Variant(None, causal)), rand(4, 8, 128, 64),
                              rand(4, 8, 128, 64), rand(4, 8, 128, 64), [], False),
        "gqa 4x8:2x128x64": (attncc.compile(attncc.Variant(None, causal)), rand(4, 8, 128, 64),
                             rand(4, 2, 128, 64), rand(4, 2, 128, 64), [], True),
        "alibi 4x8x128x64": (attncc.compile(attncc.Variant(alibi, causal)), rand(4, 8, 128, 64),
                             rand(4, 8, 128, 64), rand(4, 8, 128, 64), [slopes], False),
    }


def rows(kernel, q, k, v, captures, gqa):
    """row name -> a function making one call of that row."""
    variant = kernel.variant
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    grad = torch.randn_like(q[..., :v.shape[-1]])
    out, lse = torch.ops.attncc.attention.default(q, k, v, captures, None, variant.ir_key, variant.scale, 0.0,
                                                  variant.deterministic)
    dlse = torch.zeros_like(lse)

    def step():
        kernel(qg, kg, vg, enable_gqa=gqa).backward(grad)
        qg.grad = kg.grad = vg.grad = None

    def floor_step():
        Floor.apply(qg, kg, vg)[0].backward(grad)
        qg.grad = kg.grad = vg.grad = None

    def op_fwd():
        with torch.no_grad():
            torch.ops.attncc.attention.default(q, k, v, captures, None, variant.ir_key, variant.scale, 0.0,
                                               variant.deterministic)

    def op_bwd():
        with torch.no_grad():
            torch.ops.attncc.attention_backward.default(grad, dlse, q, k, v, out, lse, captures, None,
                                                        variant.ir_key, variant.scale, 0.0,
                                                        variant.deterministic, [])
    return {
        "floor fwd": lambda: Floor.apply(qg, kg, vg),
        "fwd nograd": lambda: kernel(q, k, v, enable_gqa=gqa),
        "fwd grad": lambda: kernel(qg, kg, vg, enable_gqa=gqa),
        "floor step": floor_step,
        "step": step,
        "op fwd": op_fwd,
        "op bwd": op_bwd,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on CUDA, "
                   "float32 on CPU, where the interpreter path converts bf16)")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--stat", default="median", choices=("median", "min"),
                   help="of the batches: min filters other processes' interference on a shared machine")
    p.add_argument("--case", default=None, help="only cases whose name contains this")
    p.add_argument("--launcher", action="store_true", help="launch through attncc.launcher.Launcher to a "
                   "compiled kernel that does nothing (default: the generated launch calls a no-op)")
    p.add_argument("--profile", default=None, help="cProfile this row (e.g. 'step') and print the top entries")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    runtime.target_for(device)  # on the CPU: the interpreter, before anything imports triton
    no_launches(args.launcher)
    print(f"attncc host time per call, kernels not launched: {device}, {dtype}, torch {torch.__version__}, "
          f"{args.stat} of {args.repeats} x {args.calls} calls (us)"
          + (", through attncc.launcher" if args.launcher else ""))
    table = {}
    for name, case in cases(device, dtype).items():
        if args.case and args.case not in name:
            continue
        table[name] = fns = rows(*case)
        for fn in fns.values():
            fn()  # generate and load every kernel first: never timed
    if args.profile:
        for name, fns in table.items():
            prof = cProfile.Profile()
            fn = fns[args.profile]
            prof.enable()
            for _ in range(args.calls * 10):
                fn()
            prof.disable()
            print(f"\n{name}: {args.profile}, {args.calls * 10} calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    names = list(next(iter(table.values())))
    print(f"{'case':20s}" + "".join(f"{n:>12s}" for n in names))
    for name, fns in table.items():
        stat = statistics.median if args.stat == "median" else min
        us = [per_call_us(fns[n], args.calls, args.repeats, stat) for n in names]
        print(f"{name:20s}" + "".join(f"{x:12.1f}" if math.isfinite(x) else f"{'-':>12s}" for x in us), flush=True)


if __name__ == "__main__":
    sys.exit(main())
