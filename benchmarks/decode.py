"""Decoding on one GPU: attncc against compiled FlexAttention and SDPA (flash, cuDNN, efficient),
bf16, one query token per sequence, GQA 8:1 (32 query heads, 4 K/V heads), head dim 128.

    python benchmarks/decode.py [--batch 1,8,64] [--kv 1024,4096,16384,65536,131072] [--page 64]
                                [--variants full,alibi,softcap] [--out DIR] [--merge]

Systems: ``attncc`` is attncc.attention's decode path on contiguous (B, Hkv, Lkv, D) tensors;
``attncc-cache`` is a contiguous attncc.KVCache and ``attncc-paged64`` a PagedKVCache with 64-token
pages handed out in shuffled order, both read through with_kvcache (per-sequence lengths read
on the GPU; "paged vs cache" compares the two). Each is
timed as eager calls (Python and launch costs included) and replayed from a CUDA graph (the
kernels alone, as a serving loop runs them); every time is the best of three medians, each call
after an L2 flush that reads 256 MiB (flush_l2).
Bandwidth is the bytes of K and V a decode step must read (B * Lkv * Hkv * (D + Dv) * 2) over
its time, against the copy bandwidth of the same GPU (a large device-to-device copy, counting
read and write); reads alone can exceed it. Writes results/<gpu>-decode.json (one row per
system and shape) and prints markdown tables; rows a system cannot run say why.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import attncc

HQ, HKV, D = 32, 4, 128
DTYPE = torch.bfloat16
SDPA = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION"}


_FLUSH = []  # 256 MiB that bench reads between calls


def flush_l2():
    """Evict the L2 cache by reading 256 MiB, which leaves it full of clean lines. do_bench's flush
    writes zeros instead, and the L2 then holds up to its size (50 MB on an H100/H200) of dirty
    lines that the timed kernel must write back to HBM before its own reads can use the space:
    ~37 MB of extra traffic. On the H200 a bare read of the K/V bytes of B=1 at 16k keys took
    17.5 us after a zeroing flush and 12.6 us after a reading one (64k: 43.6 and 35.1 us)."""
    if not _FLUSH:
        _FLUSH.append(torch.ones(128 << 20, dtype=torch.bfloat16, device="cuda"))
    _FLUSH[0].sum()


def bench(fn, reps=40):
    """Milliseconds per call of fn with a cold L2 (flush_l2 before each call), the best of three
    medians: decode timings on the H200 come out bimodal (the same kernel at ~100% or ~88% of
    copy bandwidth from one measurement to the next), so one median is noisy."""
    medians = []
    for _ in range(3):
        for _ in range(3):
            flush_l2()
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            flush_l2()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(end) for start, end in events)
        medians.append(times[len(times) // 2])
    return min(medians)


def bench_graph(fn):
    """Time of fn replayed from a CUDA graph: the kernels alone, without Python and launch costs
    (how a serving loop runs decode steps)."""
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return bench(graph.replay)


def copy_bandwidth() -> float:
    """GB/s of a 4 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**31, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6


def mods(name):
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / HQ) for i in range(HQ)], device="cuda")
    return {
        "full": (None, None),
        "alibi": (lambda s, b, h, q, k: s + slopes[h] * (k - q), None),
        "softcap": (lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0), None),
    }[name]


def systems(variant, B, L, page):
    """name -> fn() for one shape; a string value says why the system cannot run it."""
    score_mod, mask_mod = mods(variant)
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=DTYPE)
    k, v = (torch.randn(B, HKV, L, D, device="cuda", dtype=DTYPE) for _ in range(2))
    compiled = attncc.compile(attncc.Variant(score_mod, mask_mod))
    out = {"attncc": lambda: compiled(q, k, v, enable_gqa=True)}
    q_bl = q.transpose(1, 2)
    contiguous = attncc.KVCache(B, L, HKV, D, DTYPE, "cuda")
    paged = attncc.PagedKVCache(B * -(-L // page), page, HKV, D, DTYPE, "cuda", seed=0)
    for name, cache in (("attncc-cache", contiguous), (f"attncc-paged{page}", paged)):
        cache.append(k.transpose(1, 2), v.transpose(1, 2))
        out[name] = lambda cache=cache: compiled.with_kvcache(q_bl, cache)
    try:
        from torch import _dynamo
        from torch.nn.attention.flex_attention import flex_attention
        _dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        out["flex"] = lambda: flex(q, k, v, score_mod=score_mod, enable_gqa=True)
    except Exception as e:  # pragma: no cover - depends on the torch build
        out["flex"] = f"unavailable: {type(e).__name__}"
    for name, backend in SDPA.items():
        if variant != "full":
            out[name] = "no score_mod"
            continue
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run(backend=backend):
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        out[name] = run
    ref = None
    for name, fn in list(out.items()):
        if isinstance(fn, str):
            continue
        try:
            with torch.no_grad():
                o = fn()
            o = o.transpose(1, 2) if name.startswith(("attncc-cache", "attncc-paged")) else o
            ref = o.float() if ref is None else ref
            err = ((o.float() - ref).norm() / ref.norm()).item()
            if err > 2e-2:
                out[name] = f"wrong result (rel err {err:.1e} against attncc)"
        except Exception as e:
            out[name] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8,64")
    p.add_argument("--kv", default="1024,4096,16384,65536,131072")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--variants", default="full,alibi,softcap")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--merge", action="store_true", help="keep the other variants' rows of an existing JSON")
    args = p.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    peak = copy_bandwidth()
    print(f"{gpu}: copy bandwidth {peak:.0f} GB/s", file=sys.stderr)
    rows = []
    for variant in args.variants.split(","):
        for B in map(int, args.batch.split(",")):
            for L in map(int, args.kv.split(",")):
                if B * L * HKV * D * 4 > 40e9:
                    continue
                nbytes = B * L * HKV * 2 * D * 2
                for name, fn in systems(variant, B, L, args.page).items():
                    row = dict(system=name, variant=variant, B=B, Hq=HQ, Hkv=HKV, Lkv=L, D=D, gpu=gpu,
                               torch=torch.__version__, triton=__import__("triton").__version__)
                    if isinstance(fn, str):
                        row["note"] = fn
                    else:
                        with torch.no_grad():
                            ms = bench(fn)
                        row.update(ms=ms, gbps=nbytes / ms / 1e6, peak_frac=nbytes / ms / 1e6 / peak)
                        try:
                            graph_ms = bench_graph(fn)
                            row.update(graph_ms=graph_ms, graph_peak_frac=nbytes / graph_ms / 1e6 / peak)
                        except Exception as e:  # a system whose call cannot be captured
                            row["graph_note"] = f"{type(e).__name__}"
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{gpu.lower().replace(' ', '-')}-decode.json"  # nvidia-h200-decode.json
    if path.exists() and args.merge:  # keep rows of other variants from an earlier run
        old = json.loads(path.read_text())["rows"]
        rows = [r for r in old if r["variant"] not in args.variants.split(",")] + rows
    path.write_text(json.dumps(dict(copy_gbps=peak, rows=rows), indent=1))
    print(table(rows, peak, "ms", "eager calls"))
    print()
    print(table(rows, peak, "graph_ms", "replayed from CUDA graphs"))


def table(rows, peak, key_ms, title):
    """Markdown: per (variant, B, Lkv) the time of each system, attncc's speedup over flex,
    attncc's share of the copy bandwidth, and the paged cache's time over the contiguous one's."""
    names = sorted({r["system"] for r in rows}, key=lambda s: (not s.startswith("attncc"), s))
    lines = [f"{title}: microseconds per decode step; copy bandwidth {peak:.0f} GB/s", "",
             "| variant | B | Lkv | " + " | ".join(names) + " | attncc vs flex | attncc % of copy BW | paged vs cache |",
             "|---" * (len(names) + 6) + "|"]
    keys = sorted({(r["variant"], r["B"], r["Lkv"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for key in keys:
        by = {r["system"]: r for r in rows if (r["variant"], r["B"], r["Lkv"]) == key}
        ok = lambda r: r is not None and key_ms in r
        cell = lambda r: f"{1e3 * r[key_ms]:.1f}" if ok(r) else "—"
        a, f = by.get("attncc"), by.get("flex")
        ratio = f"{f[key_ms] / a[key_ms]:.2f}x" if ok(a) and ok(f) else "—"
        bw = f"{100 * kv_bytes(a) / a[key_ms] / 1e6 / peak:.0f}%" if ok(a) else "—"
        c, p = by.get("attncc-cache"), next((by[n] for n in names if n.startswith("attncc-paged")), None)
        paged = f"{p[key_ms] / c[key_ms]:.3f}" if ok(c) and ok(p) else "—"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cell(by.get(n)) for n in names)
                     + f" | {ratio} | {bw} | {paged} |")
    return "\n".join(lines)


def kv_bytes(row) -> int:
    """Bytes of K and V one decode step reads."""
    return row["B"] * row["Lkv"] * row["Hkv"] * 2 * row["D"] * 2


if __name__ == "__main__":
    main()
