"""SM clock and board power while one system's forward (and forward + backward) runs back to back
for a few seconds, systems in turn, each twice: whether a gap between two kernels is cycles or a
clock the power cap takes from one more than the other.

    python benchmarks/gluon/clocks.py [--systems attncc,fa4] [--only full,causal] [--shape 1x16x16384x128]

The systems are bench.py's; nvidia-smi is sampled about every 0.1 s."""
import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

GPU = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]  # the board nvidia-smi samples

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
from variants import make_cases  # noqa: E402


def sample(stop, out):
    while not stop.is_set():
        text = subprocess.run(["nvidia-smi", "-i", GPU, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.strip()
        out.append(tuple(float(x) for x in text.split(",")))
        time.sleep(0.05)


def measure(step, seconds):
    """ms per step and the samples (MHz, W) taken while it ran for `seconds`, after a second of warm-up."""
    for _ in range(3):  # compiles
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    while time.time() - t0 < 1.0:
        step()
    torch.cuda.synchronize()
    stop, out = threading.Event(), []
    thread = threading.Thread(target=sample, args=(stop, out))
    thread.start()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    n, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        step()
        n += 1
    end.record()
    torch.cuda.synchronize()
    stop.set()
    thread.join()
    return start.elapsed_time(end) / n, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--systems", default="attncc,fa4")
    p.add_argument("--only", default="full,causal")
    p.add_argument("--shape", default="1x16x16384x128")
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    import torch._functorch.config
    torch._functorch.config.donated_buffer = False  # the backward runs through a kept graph
    B, H, N, D = (int(x) for x in args.shape.split("x"))
    for name in args.only.split(","):
        case = make_cases(H, N, "cuda")[name]
        q, k, v = (torch.randn(B, H // (case.gqa if i else 1), N, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for i in range(3))
        grad = torch.randn_like(q)
        for system in args.systems.split(",") * 2:
            fn = bench.build(system, case, N)
            if fn is None:  # the system cannot express the variant
                continue
            for part in ("fwd", "fwd+bwd"):
                def step():
                    with torch.set_grad_enabled(part != "fwd"):
                        out = fn(q, k, v)
                        if part != "fwd":
                            out.backward(grad)
                with bench.backend(system):
                    ms, samples = measure(step, args.seconds)
                clock, power = (sorted(s[i] for s in samples) for i in (0, 1))
                print(f"{name:8s} {system:10s} {part:8s} {ms:8.3f} ms  SM clock median {clock[len(clock) // 2]:.0f} MHz "
                      f"(min {clock[0]:.0f})  power median {power[len(power) // 2]:.0f} W  ({len(samples)} samples)",
                      flush=True)


if __name__ == "__main__":
    main()
