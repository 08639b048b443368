"""Host time of a training call, attncc against compiled FlexAttention: how long Python takes to
queue one forward and one forward+backward step while the GPU is still busy with earlier work
(so nothing waits on the GPU), next to the GPU-bound times bench.py measures. A step whose host
time exceeds its kernels' time is host-bound in bench.py's table. Needs a CUDA GPU.

    python benchmarks/host_time.py [--only full,document_causal] [--shape 16x16x1024x128]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from variants import make_cases  # noqa: E402

STEPS = 30  # queued per measurement: few enough that the launch queue never fills


def host_us(fn) -> float:
    """Microseconds of host time per call of fn, queued behind a long GPU job."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(40):  # ~50 ms of matrix products: the GPU stays behind the calls below
        a @ a
    start = time.perf_counter()
    for _ in range(STEPS):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / STEPS * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="full,causal,document_causal,prefix_lm_1024,sliding_window_1024")
    p.add_argument("--shape", default="16x16x1024x128", help="BxHxNxD")
    args = p.parse_args(argv)
    B, H, N, D = (int(x) for x in args.shape.split("x"))
    import attncc  # noqa: F401  (before triton, as bench.py)
    cases = make_cases(H, N, "cuda")
    print(f"{'variant':22s} {'system':7s} {'host fwd us':>11s} {'host step us':>12s} {'fwd ms':>7s} {'step ms':>7s}")
    for name in args.only.split(","):
        case = cases[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        rand = lambda h: torch.randn(B, h, N, D, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v = (rand(h).requires_grad_() for h in (H, H // case.gqa, H // case.gqa))
        grad_out = rand(H)
        for system in ("attncc", "flex"):
            fn = bench.build(system, case, N)
            if fn is None:
                continue

            def step():
                fn(q, k, v).backward(grad_out)
                q.grad = k.grad = v.grad = None
            step()  # compile and load: never timed
            host_fwd, host_step = host_us(lambda: fn(q, k, v)), host_us(step)
            fwd_ms, step_ms = bench.bench_ms(lambda: fn(q, k, v), 25, 100), bench.bench_ms(step, 25, 100)
            print(f"{name:22s} {system:7s} {host_fwd:11.1f} {host_step:12.1f} {fwd_ms:7.3f} {step_ms:7.3f}", flush=True)


if __name__ == "__main__":
    main()
