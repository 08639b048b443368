"""Context parallelism: tokens/s of attncc's context_parallel (ring and all-gather, zigzag
layout) against one device running the whole sequence, and against torch's context_parallel
with SDPA for the causal mask where it runs.

    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --seq 131072
    torchrun --nproc-per-node 1 benchmarks/context_parallel.py --seq 16384     # one GPU: the overhead
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --seq 512 --heads 2 --dim 32  # CPU, gloo

Every rank builds the same whole q, k, v (same seed) and takes its shard. Times are medians over
--iters after --warmup calls, measured between barriers (the slowest rank counts). The one-device
figure runs the whole sequence on rank 0 while the others wait (skipped with --no-single or when
it does not fit). tokens/s = batch * whole sequence length / time; scaling = one device's time /
the group's; efficiency = scaling / ranks; rel. err: ||out - one device's out|| / ||one device's||
of the forward (auto method), a check that the run computes the right thing.
--json appends this run to a list in the file, so runs of 1, 2, 4 and 8 ranks gather in one.
--profile DIR (GPUs, two ranks or more) traces the causal ring's and all-gather's forward and
backward: how much of the ring's NCCL send/receive time runs under attention kernels, and where
rank 0's GPU time goes (kernels by name, time with none running).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

GPU = torch.cuda.is_available()
if not GPU:  # CPU tensors run in the Triton interpreter, chosen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attncc  # noqa: E402
from attncc.distributed import shard, unshard  # noqa: E402


def variants(L, device):
    docs = torch.div(torch.arange(L, device=device), max(1, L // 7), rounding_mode="floor")  # 7-8 documents
    return {
        "causal": attncc.Variant(None, lambda b, h, q, kv: q >= kv),
        "sliding_window": attncc.Variant(None, lambda b, h, q, kv: (q >= kv) & (q - kv < 4096)),
        "document": attncc.Variant(None, lambda b, h, q, kv: (docs[q] == docs[kv]) & (q >= kv)),
        "full": attncc.Variant(),
    }


OWN = []  # (what, this rank's median seconds until its own device finished, before the closing barrier)


def timed(fn, iters, warmup, device, what=None):
    """Median seconds of fn() between barriers; with ``what``, this rank's own median (until its
    device finished) goes to OWN, to show how far the ranks are apart."""
    out, own = [], []
    for i in range(warmup + iters):
        if GPU:
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        if GPU:
            torch.cuda.synchronize(device)
        mine = time.perf_counter() - start
        dist.barrier()
        if i >= warmup:
            out.append(time.perf_counter() - start)
            own.append(mine)
    if what:
        OWN.append((what, statistics.median(own)))
    return statistics.median(out)


def fwd_bwd(call, tensors, do):
    def run():
        out = call(*tensors)
        torch.autograd.backward(out, do)
    return run


def one_device(variant, q, k, v, do, gqa, args, rank, device):
    """(fwd s, fwd+bwd s) of the whole sequence on rank 0 while the others wait at the barriers,
    or None when it does not fit."""
    try:
        kernel = attncc.compile(variant)
        qf, kf, vf = (t.detach().clone().requires_grad_() for t in (q, k, v))
        call = lambda a, b, c: kernel(a, b, c, enable_gqa=gqa)  # noqa: E731
        idle = lambda: None  # noqa: E731
        return (timed((lambda: call(qf, kf, vf)) if rank == 0 else idle, args.iters, args.warmup, device),
                timed(fwd_bwd(call, (qf, kf, vf), do) if rank == 0 else idle, args.iters, args.warmup, device))
    except torch.OutOfMemoryError:
        return None


def comm_overlap(trace_path):
    """(ms of the ring's NCCL send/receive kernels, the fraction of it under a compute kernel) from a
    chrome trace: how much of the ring's communication runs while the attention kernels compute
    (only send/receive kernels count: the all-gather method's collectives are left out)."""
    with open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], "nccl" in e["name"].lower()) for e in events
               if e.get("cat") == "kernel" and e.get("ph") == "X"
               and ("nccl" not in e["name"].lower() or "sendrecv" in e["name"].lower())]
    busy, end = [], float("-inf")  # the union of the compute kernels' intervals, sorted
    for a, b, _ in sorted(k for k in kernels if not k[2]):
        if a > end:
            busy.append([a, b])
        else:
            busy[-1][1] = max(busy[-1][1], b)
        end = max(end, b)
    comm = hidden = 0.0
    for a, b, _ in (k for k in kernels if k[2]):
        comm += b - a
        hidden += sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)
    return comm / 1e3, (hidden / comm if comm else None)


def gpu_time(trace_path, runs):
    """Where rank 0's GPU time goes in a chrome trace of ``runs`` forward+backward calls: the span
    from the first kernel's start to the last one's end, the time no kernel runs in it, and the
    kernels' total time by name (the first 40 characters), per call, in ms."""
    with open(trace_path) as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    if not events:
        return None
    spans, end = [], float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        a, b = e["ts"], e["ts"] + e["dur"]
        if a > end:
            spans.append([a, b])
        else:
            spans[-1][1] = max(spans[-1][1], b)
        end = max(end, b)
    total = spans[-1][1] - spans[0][0]
    busy = sum(b - a for a, b in spans)
    by_name = {}
    for e in events:
        name = e["name"][:40]
        by_name[name] = by_name.get(name, 0.0) + e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return dict(span_ms=total / 1e3 / runs, idle_ms=(total - busy) / 1e3 / runs,
                kernels={n: round(t / 1e3 / runs, 3) for n, t in top},
                launches=len(events) / runs)


def profile_calls(call, tensors, do, args, rank, world, device, method):
    """Two forward+backward calls under torch.profiler on each rank; rank 0 writes its chrome trace
    to --profile and returns (the ring's NCCL ms per call, fraction hidden under compute, gpu_time)."""
    from torch.profiler import ProfilerActivity, profile
    run = fwd_bwd(call, tensors, do)
    run()
    torch.cuda.synchronize(device)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            run()
        torch.cuda.synchronize(device)
    dist.barrier()
    if rank != 0:
        return None
    os.makedirs(args.profile, exist_ok=True)
    path = os.path.join(args.profile, f"cp-{method}-W{world}-L{args.seq}.json")
    prof.export_chrome_trace(path)
    comm_ms, hidden = comm_overlap(path)
    return comm_ms / 2, hidden, gpu_time(path, 2)


def torch_cp_causal(q, k, v, do, args, device):
    """(fwd s, fwd+bwd s) of torch's context_parallel (SDPA, ring), or the reason it does not run."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        qf, kf, vf, dof = (t.clone() for t in (q, k, v, do))
        with context_parallel(mesh, buffers=[qf, kf, vf, dof], buffer_seq_dims=[2, 2, 2, 2]):
            qs, ks, vs = (t.detach().requires_grad_() for t in (qf, kf, vf))
            gqa = q.shape[1] != k.shape[1]
            sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=gqa)  # noqa: E731
            f = timed(lambda: sdpa(qs, ks, vs), args.iters, args.warmup, device)
            fb = timed(fwd_bwd(sdpa, (qs, ks, vs), dof), args.iters, args.warmup, device)
        return f, fb
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=32768 if GPU else 512, help="whole sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16 if GPU else 2)
    p.add_argument("--kv-heads", type=int, default=0, help="K/V heads (GQA); 0: --heads")
    p.add_argument("--dim", type=int, default=128 if GPU else 32)
    p.add_argument("--variants", default="causal,document,sliding_window")
    p.add_argument("--methods", default="ring,allgather,auto")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--iters", type=int, default=10 if GPU else 1)
    p.add_argument("--warmup", type=int, default=3 if GPU else 1)
    p.add_argument("--no-single", action="store_true", help="skip the one-device run of the whole sequence")
    p.add_argument("--no-torch-cp", action="store_true", help="skip torch's context_parallel")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    p.add_argument("--profile", default=None, help="GPU: write a chrome trace of the causal ring's forward and "
                   "backward to this folder (rank 0) and report how much of NCCL's time compute hides")
    args = p.parse_args()

    dist.init_process_group("nccl" if GPU else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if GPU else torch.device("cpu")
    if GPU:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if GPU else torch.float32
    B, H, Hkv, D, L = args.batch, args.heads, args.kv_heads or args.heads, args.dim, args.seq
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, H, L, D, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(B, Hkv, L, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    do = torch.randn(B, H, L, D, device=device, dtype=dtype, generator=g)
    qs, ks, vs, dos = (shard(t, None, layout=args.layout) for t in (q, k, v, do))
    qs, ks, vs = (t.requires_grad_() for t in (qs, ks, vs))
    tokens = B * L
    rows = []
    for name, variant in variants(L, device).items():
        if name not in args.variants.split(","):
            continue
        kernel = attncc.compile(variant)
        single = None if args.no_single else one_device(variant, q, k, v, do, H != Hkv, args, rank, device)
        with torch.no_grad():  # the result, checked against one device's on rank 0
            want = kernel(q, k, v, enable_gqa=H != Hkv) if rank == 0 else None
            got = unshard(kernel.context_parallel(qs, ks, vs, layout=args.layout, enable_gqa=H != Hkv), None,
                          layout=args.layout)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item() if rank == 0 else 0.0
            del want, got
        for method in args.methods.split(","):
            call = lambda a, b, c: kernel.context_parallel(a, b, c, layout=args.layout, method=method,  # noqa: E731
                                                           enable_gqa=H != Hkv)
            f = timed(lambda: call(qs.detach(), ks.detach(), vs.detach()), args.iters, args.warmup, device)
            fb = timed(fwd_bwd(call, (qs, ks, vs), dos), args.iters, args.warmup, device, f"{name} attncc {method}")
            rows.append(dict(variant=name, system=f"attncc {method}", fwd_s=f, fwd_bwd_s=fb, single=single, err=err))
            if args.profile and GPU and method != "auto" and name == "causal" and world > 1:
                rows[-1]["comm_ms"], rows[-1]["comm_hidden"], rows[-1]["gpu_time"] = profile_calls(
                    call, (qs, ks, vs), dos, args, rank, world, device, method) or (None, None, None)
        if name == "causal" and not args.no_torch_cp:
            res = torch_cp_causal(q, k, v, do, args, device)
            rows.append(dict(variant=name, system="torch context_parallel (SDPA)",
                             fwd_s=res[0] if isinstance(res, tuple) else None,
                             fwd_bwd_s=res[1] if isinstance(res, tuple) else None, single=single,
                             note=None if isinstance(res, tuple) else res))
    owns = [None] * world
    dist.all_gather_object(owns, OWN)
    for r in rows:  # each rank's own forward+backward (until its device finished), ms
        what = f"{r['variant']} {r['system']}"
        per_rank = [dict(o).get(what) for o in owns]
        if all(x is not None for x in per_rank):
            r["rank_fwd_bwd_s"] = per_rank
    if rank != 0:
        dist.destroy_process_group()
        return
    # the single-device times live on rank 0 only: broadcast was not needed, rows hold them there
    print(f"{world} ranks ({'NCCL' if GPU else 'gloo'}), B={B} H={H} Hkv={Hkv} D={D} L={L} {str(dtype)[6:]}, "
          f"layout {args.layout}")
    print(f"{'variant':16s} {'system':32s} {'fwd ms':>9s} {'fwd tok/s':>12s} {'f+b ms':>9s} {'f+b tok/s':>12s} "
          f"{'scaling f+b':>12s} {'eff.':>6s} {'rel. err':>9s}")
    for r in rows:
        if r["fwd_s"] is None:
            print(f"{r['variant']:16s} {r['system']:32s} {r.get('note')}")
            continue
        scale = r["single"][1] / r["fwd_bwd_s"] if r["single"] else None
        print(f"{r['variant']:16s} {r['system']:32s} {r['fwd_s'] * 1e3:9.2f} {tokens / r['fwd_s']:12,.0f} "
              f"{r['fwd_bwd_s'] * 1e3:9.2f} {tokens / r['fwd_bwd_s']:12,.0f} "
              f"{(f'{scale:.2f}x' if scale else '-'):>12s} {(f'{scale / world:.0%}' if scale else '-'):>6s} "
              f"{(format(r['err'], '.1e') if 'err' in r else '-'):>9s}")
    for r in rows:
        if r.get("comm_hidden") is not None:
            print(f"{r['variant']} {r['system']}: NCCL send/recv {r['comm_ms']:.2f} ms per forward+backward, "
                  f"{r['comm_hidden']:.0%} of it under compute kernels (trace in {args.profile})")
        if r.get("rank_fwd_bwd_s"):
            print(f"{r['variant']} {r['system']}: forward+backward per rank until its device finished (ms): "
                  + ", ".join(f"{x * 1e3:.2f}" for x in r["rank_fwd_bwd_s"]))
        g = r.get("gpu_time")
        if g:
            print(f"{r['variant']} {r['system']}: rank 0's GPU per forward+backward: span {g['span_ms']:.2f} ms, "
                  f"no kernel running {g['idle_ms']:.2f} ms, {g['launches']:.0f} kernels; by name (ms): "
                  + ", ".join(f"{n} {t}" for n, t in g["kernels"].items()))
    for name, (f, fb) in {r["variant"]: r["single"] for r in rows if r.get("single")}.items():
        print(f"{name:16s} {'one device, whole sequence':32s} {f * 1e3:9.2f} {tokens / f:12,.0f} {fb * 1e3:9.2f} "
              f"{tokens / fb:12,.0f}")
    if args.json:  # one entry per run: runs of 1, 2, 4 and 8 ranks gather in one file
        runs = json.load(open(args.json)) if os.path.exists(args.json) else []
        runs.append(dict(world=world, backend="nccl" if GPU else "gloo", B=B, H=H, Hkv=Hkv, D=D, L=L,
                         layout=args.layout, gpu=torch.cuda.get_device_name() if GPU else None,
                         torch=torch.__version__, rows=rows))
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
