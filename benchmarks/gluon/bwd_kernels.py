"""Where a backward's GPU time goes, kernel by kernel: the backward of attncc and of its peers
(bench.py's systems) run under torch.profiler, each kernel's device time averaged per backward.
It separates a backward's main kernel from its passes (Delta, dQ's conversion, zero fills, GQA
sums) and from host time (the whole backward as bench.py times it, beside the kernels' sum).

    python benchmarks/gluon/bwd_kernels.py [--shapes 4x16x4096x128] [--only full,sliding_window_1024]
        [--systems attncc,fa4] [--iters 20]
"""
import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
from variants import make_cases  # noqa: E402


def kernel_times(backward, iters):
    """{kernel name: mean device µs per backward} over `iters` calls of backward()."""
    from torch.profiler import ProfilerActivity, profile
    backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            backward()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / iters
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4x16x4096x128,1x16x16384x128,4x32x4096x64")
    p.add_argument("--only", default="full,causal,sliding_window_1024")
    p.add_argument("--systems", default="attncc,fa4")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    summary = []
    for shape in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        B, H, N, D = shape
        cases = make_cases(H, N, "cuda")
        for name in args.only.split(","):
            case = cases[name]
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, h, N, D, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
                       for h in (H, H // case.gqa, H // case.gqa))
            grad = torch.randn_like(q)
            for system in args.systems.split(","):
                fn = bench.build(system, case, N)
                if fn is None:
                    continue
                with bench.backend(system):
                    out = fn(q, k, v)

                    def backward():
                        q.grad = k.grad = v.grad = None
                        out.backward(grad, retain_graph=True)
                    times = kernel_times(backward, args.iters)
                    whole = bench.bench_ms(backward, 25, 100) * 1e3
                print(f"\n{name} {'x'.join(map(str, shape))} {system}: kernels {sum(times.values()):.0f} µs, "
                      f"backward (do_bench) {whole:.0f} µs")
                for kname, us in sorted(times.items(), key=lambda kv: -kv[1]):
                    print(f"  {us:8.1f} µs  {kname[:110]}")
                top = max(times.values())
                summary.append((name, "x".join(map(str, shape)), system, whole, sum(times.values()), top))
    print("\n| variant | shape | system | backward µs | kernels' sum | main kernel | other kernels |")
    print("|---|---|---|--:|--:|--:|--:|")
    for name, shape, system, whole, total, top in summary:
        print(f"| {name} | {shape} | {system} | {whole:.0f} | {total:.0f} | {top:.0f} | {total - top:.0f} |")


if __name__ == "__main__":
    main()
