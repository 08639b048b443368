"""Issue 33's measurement: examples/gpt.py's model (4 layers, causal + ALiBi) trained with torch
SDPA and with attncc, eager and under torch.compile (mode "default", and "reduce-overhead",
which replays CUDA graphs), in ms per training step; and where the host time goes: host time
per step and per attention call (forward; forward + backward) of one layer's shapes. The target:
attncc's step within 10% of SDPA's in every mode.

    python benchmarks/gpt_step.py                       # on a GPU: the table
    python benchmarks/gpt_step.py --modes eager --steps 3   # CPU smoke run (Triton interpreter)

Columns:
    ms/step        median of --repeats timings of --steps steps (CUDA events): forward under bf16
                   autocast, cross entropy, backward, AdamW, as examples/gpt.py's train()
    host ms/step   median wall time of one step's Python, each step started on an idle GPU: below
                   ms/step the step is GPU-bound, near it host-bound
    host us fwd    host time of one attention call, queued behind a long GPU job
    host us f+b    the same for forward + backward (benchmarks/host_time.py's method)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]

import attncc.runtime  # noqa: E402

attncc.runtime.target_for(torch.device("cuda" if torch.cuda.is_available() else "cpu"))  # before triton's import
import gpt  # noqa: E402  (examples/gpt.py: the model, its config, SDPACore)

MODES = ("eager", "default", "reduce-overhead")
CORES = {"sdpa": gpt.SDPACore, "attncc": gpt.attncc_core}


def build(system: str, mode: str, cfg, state):
    """(model, forward) of one system in one mode, from the shared initial weights."""
    model = gpt.GPT(cfg, CORES[system]).to(gpt.DEVICE)
    model.load_state_dict(state)
    if mode == "eager":
        return model, model
    return model, torch.compile(model, mode=mode, fullgraph=True, dynamic=False)


def step_function(model, forward, data, cfg, graphs: bool):
    """One training step as examples/gpt.py's train() takes it, without reading the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    inputs, targets = data[:, :-1], data[:, 1:]

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(gpt.DEVICE.type, dtype=gpt.DTYPE, enabled=gpt.GPU):
            logits = forward(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss
    return step


def sync():
    if gpt.GPU:
        torch.cuda.synchronize()


def ms_per_step(step, steps: int, repeats: int) -> float:
    """Median over ``repeats`` of the ms per step of ``steps`` steps in a row."""
    times = []
    for _ in range(repeats):
        sync()
        if gpt.GPU:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times)


def host_ms_per_step(step, steps: int) -> float:
    """Median wall time of one step's Python, started on an idle GPU (nothing waits on it)."""
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    sync()
    return statistics.median(times)


def attention_host_us(system: str, mode: str, cfg):
    """(forward, forward + backward) host us of one attention call at one layer's shapes
    (B, L, H, D) in the autocast dtype; None off CUDA (host_time.host_us queues behind a GPU job)."""
    if not gpt.GPU:
        return None, None
    from host_time import host_us
    core = CORES[system](cfg, gpt.alibi_slopes(cfg.heads)).to(gpt.DEVICE)
    fn = core if mode == "eager" else torch.compile(core, mode=mode, fullgraph=True, dynamic=False)
    shape = (cfg.batch, cfg.seq_len, cfg.heads, cfg.d_model // cfg.heads)
    q, k, v = (torch.randn(shape, device=gpt.DEVICE, dtype=gpt.DTYPE, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=gpt.DEVICE, dtype=gpt.DTYPE)
    graphs = mode == "reduce-overhead"

    def forward():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        fn(q, k, v).backward(grad)
        q.grad = k.grad = v.grad = None
    return host_us(forward), host_us(forward_backward)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES) if torch.cuda.is_available() else "eager",
                   help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--systems", default="sdpa,attncc")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    cfg = gpt.CONFIG
    print(f"GPT {cfg} on {gpt.DEVICE} ({torch.cuda.get_device_name() if gpt.GPU else 'Triton interpreter'}), "
          f"torch {torch.__version__}, autocast {gpt.DTYPE}")
    torch.manual_seed(0)
    data = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), device=gpt.DEVICE)
    state = {k: v.clone() for k, v in gpt.GPT(cfg, gpt.SDPACore).to(gpt.DEVICE).state_dict().items()}
    print(f"{'system':8s} {'mode':16s} {'ms/step':>8s} {'vs sdpa':>8s} {'host ms/step':>12s} "
          f"{'host us fwd':>11s} {'host us f+b':>11s}")
    baseline = {}
    for mode in args.modes.split(","):
        for system in args.systems.split(","):
            model, forward = build(system, mode, cfg, state)
            step = step_function(model, forward, data, cfg, graphs=mode == "reduce-overhead")
            for _ in range(3):  # compile, load, record the graphs: never timed
                step()
            ms = ms_per_step(step, args.steps, args.repeats)
            host = host_ms_per_step(step, args.steps)
            fwd_us, step_us = attention_host_us(system, mode, cfg)
            baseline.setdefault(mode, ms if system == "sdpa" else None)
            ratio = f"{ms / baseline[mode]:8.2f}" if baseline[mode] else f"{'-':>8s}"
            us = "".join(f" {x:11.1f}" if x is not None else f" {'-':>11s}" for x in (fwd_us, step_us))
            print(f"{system:8s} {mode:16s} {ms:8.2f} {ratio} {host:12.2f}{us}", flush=True)
            del model, forward, step
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
