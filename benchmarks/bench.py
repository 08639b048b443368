"""attncc against compiled FlexAttention and SDPA (flash, cuDNN) on one GPU: bf16, forward and
forward+backward, ten variants, plus first-call latency in fresh processes.

    python benchmarks/bench.py [--quick] [--only VARIANT,...] [--shapes BxHxNxD,...]
                               [--warmup MS] [--rep MS] [--rounds N] [--latency all|none|VARIANT,...]
                               [--latency-shape BxHxNxD] [--out DIR]

What is measured and how TFLOP/s are counted: benchmarks/README.md. The internal
``--latency-child SYSTEM VARIANT`` runs one first call and prints it as a JSON line.
"""
import time

_T0 = time.perf_counter()  # process start, before torch is imported (latency children report it)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_speedups, fmt, fmt_shape, latency_table, plot, progress_line, save, timing_table  # noqa
from variants import NAMES, density, make_cases  # noqa: E402

SHAPES = ((16, 16, 1024, 128), (4, 16, 4096, 128), (1, 16, 16384, 128), (4, 32, 4096, 64))
QUICK_SHAPES = ((4, 16, 4096, 128),)
LATENCY_SHAPE = (4, 16, 4096, 128)
QUICK_LATENCY = ("causal",)
SYSTEMS = ("attncc", "flex", "flex-flash", "fa4", "sdpa-flash", "sdpa-cudnn")
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
TOL = 2e-2  # relative error of attncc's output and gradients against the reference system (bf16)
DEVICE, DTYPE = "cuda", torch.bfloat16
RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------- the systems

def attncc_fn(case, training=True):
    """fn(q, k, v) through one compiled attncc kernel (tracing happens here, not in the timed loop)."""
    import attncc
    kernel = attncc.compile(attncc.Variant(case.score_mod, case.mask_mod, dropout_p=case.dropout_p))
    return lambda q, k, v: kernel(q, k, v, enable_gqa=case.gqa > 1, training=training)


def compile_flex():
    """A fresh torch.compile(flex_attention): dynamo is reset first, or its recompile limit
    silently falls back to an unfused path and the numbers collapse (anchors README)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention
    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


def flex_fn(case, N, kernel_options=None):
    """Compiled FlexAttention; kernel_options={"BACKEND": "FLASH"} is its FlashAttention-4 (CuTe DSL)
    backend (torch >= 2.11 with flash-attn-4 installed), which inlines the mods into FA4's kernels."""
    from torch.nn.attention.flex_attention import create_block_mask
    flex = compile_flex()
    mask = create_block_mask(case.mask_mod, None, None, N, N, device=DEVICE) if case.mask_mod else None
    return lambda q, k, v: flex(q, k, v, score_mod=case.score_mod, block_mask=mask, enable_gqa=case.gqa > 1,
                                kernel_options=kernel_options)


def fa4_fn(case):
    """flash_attn.cute.flash_attn_func (FlashAttention-4), where its arguments express the variant.
    It takes (B, N, H, D): the transposes are views, and its output is viewed back."""
    from flash_attn.cute import flash_attn_func

    def fn(q, k, v):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **case.fa4)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return fn


def sdpa_fn(case, training=True):
    kwargs = dict(case.sdpa, dropout_p=case.sdpa.get("dropout_p", 0.0) if training else 0.0)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)


def build(system, case, N, training=True, kernel_options=None):
    """fn(q, k, v) of one system for one case; None where the system cannot express it
    (kernel_options: FlexAttention's Triton backend's)."""
    if system == "attncc":
        return attncc_fn(case, training)
    if system == "flex":
        return flex_fn(case, N, kernel_options) if case.flex else None
    if system == "flex-flash":
        return flex_fn(case, N, {"BACKEND": "FLASH"}) if case.flex else None
    if system == "fa4":
        return fa4_fn(case) if case.fa4 is not None else None
    return sdpa_fn(case, training) if system in case.sdpa_backends else None


def backend(system):
    """The SDPA backend context of a system (entered around its calls, not inside the timed fn)."""
    if system not in SDPA_BACKENDS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[system]))


def not_available(system, case):
    if system in ("flex", "flex-flash"):
        return "n/a: FlexAttention has no dropout"
    if system == "fa4":
        return "n/a: flash_attn_func's arguments cannot express it"
    if case.sdpa is not None:
        return f"n/a: compared with {', '.join(case.sdpa_backends)} only"
    return "n/a: SDPA cannot express it natively"


# FlexAttention's Triton backend with tiles that fit: where its autotuner's candidates all overflow
# shared memory (H200, learnable relative bias: the backward at head dim 128, the forward at 64),
# it runs with these instead, and its rows say so
FLEX_SMALL_TILES = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, num_stages=1,
                        num_warps=4)


def overflows_shared_memory(e: Exception) -> bool:
    return "out of resource" in str(e) or "No valid triton configs" in str(e)


# ---------------------------------------------------------------- timing and checks

def bench_ms(fn, warmup, rep, grad_to_none=None):
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def time_fwd_bwd(fn, q, k, v, leaves, grad_out, warmup, rep):
    """Median ms of the forward alone, of the backward alone (torch.autograd.grad through one
    forward's graph, kept) and of forward + out.backward(grad_out), grads cleared before every
    call (outside the timed region). The backward is timed on its own rather than as the difference
    of the other two: a system whose forward alone measures slower than inside a training step
    (H100, 2026-11-27: FlexAttention's FLASH backend, causal 4x16x4096x128, forward alone 0.78 ms
    against FA4's 0.48, "backward" 1.11 against FA4's 1.35) had its backward understated."""
    def step():
        fn(q, k, v).backward(grad_out)
    step()  # compile, load, autotune: never timed
    fwd_ms = bench_ms(lambda: fn(q, k, v), warmup, rep)
    out = fn(q, k, v)
    bwd_ms = bench_ms(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True), warmup, rep)
    del out
    fwdbwd_ms = bench_ms(step, warmup, rep, grad_to_none=leaves)
    for t in leaves:
        t.grad = None
    return fwd_ms, bwd_ms, fwdbwd_ms


def rel_err(a, b) -> float:
    e = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
    return e if math.isfinite(e) else float("inf")


def check(fn, ref, ref_system, q, k, v, leaves, grad_out) -> dict:
    """Relative errors of fn's output and gradients (q, k, v, learnable captures) against ref's."""
    results = []
    for f, system in ((fn, "attncc"), (ref, ref_system)):
        with backend(system):
            out = f(q, k, v)
            results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    names = ["out", "dq", "dk", "dv"] + [f"dcap{i}" for i in range(len(leaves) - 3)]
    return {n: rel_err(a, b) for n, a, b in zip(names, *results)}


def flops(B, H, N, D, dens):
    """Forward FLOPs of the unmasked entries: two N x N x D matmuls, 2 FLOPs per multiply-add."""
    return 4 * B * H * N * N * D * dens


def timing_row(system, base, fwd_ms=None, bwd_ms=None, fwdbwd_ms=None, note=None, **extra):
    f = flops(base["B"], base["H"], base["N"], base["D"], base["density"])
    return dict(kind="timing", system=system, **base, fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwdbwd_ms=fwdbwd_ms,
                fwd_tflops=f / fwd_ms / 1e9 if fwd_ms else None,
                bwd_tflops=2.5 * f / bwd_ms / 1e9 if bwd_ms and bwd_ms > 0 else None,
                fwdbwd_tflops=3.5 * f / fwdbwd_ms / 1e9 if fwdbwd_ms else None, note=note, **extra)


def bench_case(case, shape, warmup, rep, systems=SYSTEMS, rounds=1):
    """Rows of each system for one variant at one shape: check attncc, then time the systems in
    turn, `rounds` times (each row keeps the median of its rounds, per time: a drift of the GPU's
    clock or of another process's load then touches every system alike). Every other round runs
    the systems in reverse order, so that no system always takes the first or the last place of a
    round (the probes saw the same kernel up to 10 % slower when timed last)."""
    B, H, N, D = shape
    Hkv = H // case.gqa
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rand = lambda h: torch.randn(B, h, N, D, generator=g, device=DEVICE, dtype=DTYPE)  # noqa: E731
    q, k, v = (rand(h).requires_grad_() for h in (H, Hkv, Hkv))
    grad_out = rand(H)
    leaves = [q, k, v, *case.learnable]
    base = dict(variant=case.name, B=B, H=H, Hkv=Hkv, N=N, D=D, density=density(case.mask_mod, N, DEVICE))
    fns = {}
    for system in systems:
        try:
            fns[system] = build(system, case, N)
        except Exception as e:  # a system that fails to build gets a note row, the others still run
            fns[system] = e
    small_tiles = {}  # system -> its rows' note, once it runs with FLEX_SMALL_TILES

    def run(system, call):
        """call(fns[system]); FlexAttention's Triton backend once more with FLEX_SMALL_TILES where its
        own tiles overflow shared memory."""
        try:
            return call(fns[system])
        except Exception as e:
            if system != "flex" or system in small_tiles or not overflows_shared_memory(e):
                raise
            fns[system] = build(system, case, N, kernel_options=FLEX_SMALL_TILES)
            small_tiles[system] = f"kernel_options {FLEX_SMALL_TILES}: its autotuner's tiles overflow shared memory"
            return call(fns[system])

    extra = dict(check_ref=None, check_errors={"error": "no reference system ran"}, check_ok=None)
    for ref_system in (s for s in ("sdpa-flash", "flex") if callable(fns.get(s))):
        try:  # dropout: both sides with dropout off (the masks of two systems never agree)
            if case.dropout_p:
                pair = [build(s, case, N, training=False) for s in ("attncc", ref_system)]
                errs = check(*pair, ref_system, q, k, v, leaves, grad_out)
            else:
                errs = run(ref_system, lambda ref: check(fns["attncc"], ref, ref_system, q, k, v, leaves, grad_out))
        except Exception as e:
            extra["check_errors"] = {"error": f"{ref_system}: {type(e).__name__}: {str(e)[:200]}"}
            continue
        extra = dict(check_ref=ref_system + (" (dropout off)" if case.dropout_p else ""), check_errors=errs,
                     check_ok=all(e < TOL for e in errs.values()))
        break
    times = {}  # system -> [(fwd, bwd, fwd+bwd ms) per round], or the exception that stopped it
    for r in range(rounds):
        for system in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
            fn = fns[system]
            if fn is None or isinstance(times.get(system), Exception):
                continue
            try:
                if isinstance(fn, Exception):
                    raise fn
                with backend(system):
                    times.setdefault(system, []).append(
                        run(system, lambda f: time_fwd_bwd(f, q, k, v, leaves, grad_out, warmup, rep)))
            except Exception as e:
                times[system] = e
    rows = []
    for system in systems:
        got, note = times.get(system), None
        if fns[system] is None:
            rows.append(timing_row(system, base, note=not_available(system, case)))
            continue
        if system == "attncc" and extra["check_ok"] is not True:
            note = (f"CHECK FAILED vs {extra['check_ref']}: " if extra["check_ok"] is False else "unchecked: ") + \
                ", ".join(f"{n} {e:.1e}" if isinstance(e, float) else str(e) for n, e in extra["check_errors"].items())
            print(f"WARNING attncc {case.name} {fmt_shape(shape)}: {note}", flush=True)
        if isinstance(got, Exception):
            row = timing_row(system, base, note=f"error: {type(got).__name__}: {str(got)[:200]}")
        else:
            note = note or small_tiles.get(system)
            medians = [statistics.median(t[i] for t in got) for i in range(3)]
            row = timing_row(system, base, *medians, note, rounds=len(got), **(extra if system == "attncc" else {}))
        rows.append(row)
        print(progress_line(row), flush=True)
    return rows


# ---------------------------------------------------------------- first-call latency

def latency_child(system, name, shape):
    """In a fresh process: trace/compile + first forward of one variant, printed as a JSON line."""
    B, H, N, D = shape
    case = make_cases(H, N, DEVICE)[name]
    q, k, v = (torch.randn(B, h, N, D, device=DEVICE, dtype=DTYPE) for h in (H, H // case.gqa, H // case.gqa))
    importlib.import_module("attncc" if system == "attncc" else "torch.nn.attention.flex_attention")  # not timed
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        fn = build(system, case, N)
        fn(q, k, v)
        torch.cuda.synchronize()
    print(json.dumps(dict(system=system, variant=name, first_call_s=time.perf_counter() - t0, setup_s=t0 - _T0)))


def run_child(system, name, shape, env):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--latency-child", system, name,
           "--latency-shape", fmt_shape(shape)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return dict(error="timeout after 600 s")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return dict(error=(p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:200])
    return dict(json.loads(lines[-1]), process_s=time.perf_counter() - t0)


def measure_latency(names, shape, rows, on_row=lambda: None):
    """Appends to rows, per variant and system, a cold child (empty cache dirs) and a warm one (the
    same dirs, filled by the cold one)."""
    B, H, N, D = shape
    for name in names:
        for system in ("attncc", "flex"):
            row = dict(kind="first_call", system=system, variant=name, B=B, H=H, N=N, D=D)
            if system == "flex" and not make_cases(H, N, "cpu")[name].flex:
                rows.append(dict(row, note="n/a: FlexAttention has no dropout"))
                on_row()
                continue
            with tempfile.TemporaryDirectory(prefix=f"bench-{system}-") as tmp:
                env = dict(os.environ, ATTNCC_CACHE_DIR=f"{tmp}/attncc", TRITON_CACHE_DIR=f"{tmp}/triton",
                           TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor")
                cold = run_child(system, name, shape, env)
                warm = run_child(system, name, shape, env)
            row.update(cold_s=cold.get("first_call_s"), warm_s=warm.get("first_call_s"),
                       cold_process_s=cold.get("process_s"), warm_process_s=warm.get("process_s"),
                       setup_s=cold.get("setup_s"), note=cold.get("error") or warm.get("error"))
            rows.append(row)
            on_row()
            print(f"first call {system:7s} {name:22s} cold {fmt(row['cold_s'], '.2f')} s  "
                  f"warm {fmt(row['warm_s'], '.2f')} s  {row['note'] or ''}", flush=True)


def gpu_name():
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def git_commit():
    """The checkout's commit (+ "-dirty" with local changes); $ATTNCC_COMMIT where the benchmark
    runs from an exported copy of a commit (inside another checkout, git would name that one's);
    None where neither tells."""
    if os.environ.get("ATTNCC_COMMIT"):
        return os.environ["ATTNCC_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)  # noqa
    try:
        top, head = run("rev-parse", "--show-toplevel"), run("rev-parse", "--short", "HEAD")
        status = run("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return None
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:
        return None  # not the root of a checkout: a copy whose commit git cannot tell
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "") if head.returncode == 0 else None


def environment(args):
    """Carried by every result row: what ran, where and how."""
    import attncc
    import triton
    from attncc import toolchain
    return dict(gpu=gpu_name(), torch=torch.__version__, triton=triton.__version__, attncc=attncc.__version__,
                attncc_commit=git_commit(), cuda=torch.version.cuda, gluon_bwd_ptxas=toolchain.describe(),
                dtype=str(DTYPE).removeprefix("torch."), warmup_ms=args.warmup, rep_ms=args.rep, date=time.strftime("%Y-%m-%d %H:%M"))


def parse_args(argv=None):
    shapes = lambda s: [] if s == "none" else [tuple(int(x) for x in it.split("x")) for it in s.split(",")]  # noqa
    p = argparse.ArgumentParser(description="attncc vs compiled FlexAttention vs SDPA (flash, cuDNN): bf16 fwd and "
                                "fwd+bwd timings, first-call latency. See benchmarks/README.md.")
    p.add_argument("--quick", action="store_true", help="one shape (4x16x4096x128); first-call latency of causal only")
    p.add_argument("--only", help=f"comma-separated variants among: {', '.join(NAMES)}")
    p.add_argument("--shapes", type=shapes, help="comma-separated BxHxNxD (e.g. 4x16x4096x128,4x32x4096x64), "
                   "or none for first-call latency only")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated systems among: {', '.join(SYSTEMS)} (default all; attncc is checked "
                   "against sdpa-flash or flex only when one of them runs; flex-flash and fa4 need flash-attn-4)")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warmup, ms (default 25)")
    p.add_argument("--rep", type=float, default=100, help="do_bench repetition time, ms (default 100)")
    p.add_argument("--rounds", type=int, default=1, help="time the systems of a cell in turn this many times, every other "
                   "round in reverse order, and keep each time's median (default 1)")
    p.add_argument("--latency", help="first-call latency for: all | none | VARIANT,... (default: the --only "
                   "variants, else all; --quick: causal)")
    p.add_argument("--latency-shape", type=lambda s: shapes(s)[0], default=LATENCY_SHAPE,
                   help="BxHxNxD of the first-call measurement (default 4x16x4096x128)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for <gpu>.json and <gpu>.png")
    p.add_argument("--latency-child", nargs=2, metavar=("SYSTEM", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.names = args.only.split(",") if args.only else list(NAMES)
    lat = args.latency or (",".join(QUICK_LATENCY) if args.quick else ",".join(args.names))
    args.latency_names = [] if lat == "none" else list(NAMES) if lat == "all" else lat.split(",")
    args.systems = args.systems.split(",")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if any(s not in SYSTEMS for s in args.systems):
        p.error(f"unknown system in {','.join(args.systems)}; choose among {', '.join(SYSTEMS)}")
    bad = [n for n in dict.fromkeys(args.names + args.latency_names) if n not in NAMES]
    if bad:
        p.error(f"unknown variant(s) {', '.join(bad)}; choose among {', '.join(NAMES)}")
    if args.shapes is None:
        args.shapes = QUICK_SHAPES if args.quick else SHAPES
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.latency_child:
        return latency_child(*args.latency_child, args.latency_shape)
    import attncc  # noqa: F401  (before triton: on a CPU-only machine attncc switches the interpreter on)
    import torch._dynamo
    torch.manual_seed(0)
    for knob in ("recompile_limit", "cache_size_limit"):  # as the anchors; each variant is compiled fresh anyway
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 1000)
    # The backward is timed through one kept graph (time_fwd_bwd); a compiled graph that donates
    # its saved buffers to the backward refuses retain_graph. Donation saves memory, not time.
    import torch._functorch.config
    torch._functorch.config.donated_buffer = False
    env = environment(args)
    print(" ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    path = args.out / (re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-") + ".json")
    t_start, rows, latency = time.perf_counter(), [], []
    for shape in args.shapes:
        t = time.perf_counter()
        cases = make_cases(shape[1], shape[2], DEVICE)
        for name in args.names:
            if shape[1] % cases[name].gqa == 0:
                rows += bench_case(cases[name], shape, args.warmup, args.rep, args.systems, args.rounds)
                save(rows, env, path)  # after every case: a run cut short keeps what it measured
        print(f"-- {fmt_shape(shape)} done in {time.perf_counter() - t:.0f} s", flush=True)
    if args.latency_names:
        t = time.perf_counter()
        measure_latency(args.latency_names, args.latency_shape, latency, lambda: save(rows + latency, env, path))
        print(f"-- first-call latency done in {time.perf_counter() - t:.0f} s", flush=True)
    merged = save(rows + latency, env, path)
    print(f"wrote {path} ({len(merged)} rows, {len(rows) + len(latency)} from this run)")
    plot(merged, path.with_suffix(".png"))
    if latency:
        print(f"\nFirst call (trace/compile + first forward, {fmt_shape(args.latency_shape)}, fresh process; "
              "cold: empty cache dirs, warm: the same dirs filled by the cold run)\n")
        print(latency_table(latency))
    if not rows:
        return
    add_speedups(rows)
    print(f"\nattncc vs FlexAttention vs SDPA, {env['gpu']}, {env['dtype']}, median of do_bench "
          f"(ratios: other ms / attncc ms, > 1 means attncc is faster); total {time.perf_counter() - t_start:.0f} s\n")
    print(timing_table(rows))


if __name__ == "__main__":
    main()
