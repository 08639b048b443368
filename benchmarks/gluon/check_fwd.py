"""GPU check of the Gluon sm90 attention forward: correctness, then timing vs torch SDPA.

    python3 benchmarks/gluon/check_fwd.py            # correctness matrix + benchmark, table last
    python3 benchmarks/gluon/check_fwd.py --smoke    # one small case (catches hangs cheaply)
    python3 benchmarks/gluon/check_fwd.py --no-bench / --no-check / --variants

Correctness: fresh random inputs per case, float64 torch reference (per head), outputs poisoned
with NaN before the call, NaN/inf never passes.  Out error must be <= max(2 x the error of torch
SDPA in the same dtype, a dtype floor); lse error <= 2e-3 (absolute, natural log).
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fwd_sm90  # noqa: E402

DEV = "cuda"


def reference(q, k, v, causal, sm_scale):
    """float64 out and natural-log lse, top-left causal (q_idx >= kv_idx), one head at a time."""
    B, H, Lq, D = q.shape
    Lkv = k.shape[2]
    out = torch.empty(B, H, Lq, D, dtype=torch.float64, device=q.device)
    lse = torch.empty(B, H, Lq, dtype=torch.float64, device=q.device)
    mask = None
    if causal:
        mask = torch.arange(Lq, device=q.device)[:, None] < torch.arange(Lkv, device=q.device)[None, :]
    for b in range(B):
        for h in range(H):
            s = (q[b, h].double() @ k[b, h].double().T) * sm_scale
            if mask is not None:
                s = s.masked_fill(mask, -float("inf"))
            lse[b, h] = torch.logsumexp(s, dim=-1)
            out[b, h] = torch.softmax(s, dim=-1) @ v[b, h].double()
    return out, lse


def sdpa(q, k, v, causal, sm_scale, backend=None):
    from torch.nn.attention import sdpa_kernel, SDPBackend
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel([be]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def check_case(B, H, Lq, Lkv, D, causal, dtype, **cfg):
    q = torch.randn(B, H, Lq, D, device=DEV, dtype=dtype)
    k = torch.randn(B, H, Lkv, D, device=DEV, dtype=dtype)
    v = torch.randn(B, H, Lkv, D, device=DEV, dtype=dtype)
    sm_scale = 1.0 / math.sqrt(D)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, Lq), float("nan"), device=DEV, dtype=torch.float32)
    fwd_sm90.attention(q, k, v, causal, sm_scale, out=out, lse=lse, **cfg)
    torch.cuda.synchronize()
    ro, rl = reference(q, k, v, causal, sm_scale)
    finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    err = (out.double() - ro).abs().max().item() if finite else float("nan")
    lerr = (lse.double() - rl).abs().max().item() if finite else float("nan")
    try:
        serr = (sdpa(q, k, v, causal, sm_scale).double() - ro).abs().max().item()
    except Exception:  # noqa: BLE001
        serr = float("nan")
    floor = 4e-3 if dtype == torch.bfloat16 else 1e-3
    tol = max(2.0 * serr, floor) if serr == serr else floor
    ok = finite and err <= tol and lerr <= 2e-3
    return ok, err, serr, lerr, tol


def run_checks(args):
    shapes = [(1, 1), (17, 17), (1000, 1000), (4096, 4096), (17, 1000), (1000, 17), (1, 4096), (4096, 1000),
              (1000, 4096)]
    cases = []
    for D in (128, 64):
        for causal in (False, True):
            for dtype in (torch.bfloat16, torch.float16):
                for Lq, Lkv in shapes:
                    BH = (2, 2) if max(Lq, Lkv) >= 4096 else (2, 3)
                    cases.append((BH[0], BH[1], Lq, Lkv, D, causal, dtype, {}))
    # more tiles than SMs: exercises the persistent tile loop (ring/phase carry-over between tiles)
    for D in (128, 64):
        for causal in (False, True):
            cases.append((4, 8, 4096, 4096, D, causal, torch.bfloat16, {}))
            cases.append((3, 20, 1000, 777, D, causal, torch.float16, {}))
    if args.variants:
        for D, Lkv in ((128, 1000), (64, 3000)):
            for cfg in variant_cfgs(D):
                for causal in (False, True):
                    cases.append((2, 8, 2048, Lkv, D, causal, torch.bfloat16, cfg))
    n_fail = 0
    worst = 0.0
    t0 = time.time()
    for B, H, Lq, Lkv, D, causal, dtype, cfg in cases:
        torch.manual_seed(hash((B, H, Lq, Lkv, D, causal, str(dtype), str(cfg))) % 2**31)
        try:
            ok, err, serr, lerr, tol = check_case(B, H, Lq, Lkv, D, causal, dtype, **cfg)
        except Exception as e:  # noqa: BLE001
            ok, err, serr, lerr, tol = False, float("nan"), float("nan"), float("nan"), 0.0
            print(f"  EXC {type(e).__name__}: {str(e)[:300]}")
        worst = max(worst, err / tol) if err == err else float("inf")
        line = (f"{'ok  ' if ok else 'FAIL'} B{B} H{H} Lq{Lq:>5} Lkv{Lkv:>5} D{D:>3} {'causal' if causal else 'full  '} "
                f"{str(dtype)[6:]:>8} {cfg or ''} err={err:.2e} sdpa_err={serr:.2e} lse_err={lerr:.1e}")
        LOG.append(line)
        if not ok:
            n_fail += 1
            print(line, flush=True)
    summary = (f"correctness: {len(cases) - n_fail}/{len(cases)} cases pass "
               f"(worst err/tol {worst:.2f}; {time.time() - t0:.0f}s)")
    print(summary, flush=True)
    return summary, n_fail


def variant_cfgs(D):
    # --variants: configurations worth re-measuring (see NOTES.md)
    if D == 128:
        return [dict(PINGPONG=0), dict(PINGPONG=2), dict(PERSISTENT=True), dict(PERSISTENT=False)]
    return [dict(PINGPONG=0), dict(NUM_WG=3, STAGES=4), dict(PERSISTENT=True), dict(PERSISTENT=False)]


def bench(args):
    from triton.testing import do_bench
    rows = []
    shapes = [(4, 16, 4096, 128), (1, 16, 16384, 128), (4, 32, 4096, 64)]
    for B, H, L, D in shapes:
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
            flops = 4.0 * B * H * L * L * D * (0.5 if causal else 1.0)
            sm_scale = 1.0 / math.sqrt(D)
            res = {}
            fns = {"gluon": lambda: fwd_sm90.attention(q, k, v, causal, sm_scale)}
            if args.variants:
                for i, cfg in enumerate(variant_cfgs(D)):
                    fns[f"v{i}"] = (lambda c: (lambda: fwd_sm90.attention(q, k, v, causal, sm_scale, **c)))(cfg)
            fns["flash"] = lambda: sdpa(q, k, v, causal, sm_scale, "flash")
            fns["cudnn"] = lambda: sdpa(q, k, v, causal, sm_scale, "cudnn")
            for name, fn in fns.items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    res[name] = do_bench(fn, warmup=50, rep=200, return_mode="median")
                except Exception as e:  # noqa: BLE001
                    res[name] = float("nan")
                    print(f"  bench {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append((f"{B}x{H}x{L}x{D} {'causal' if causal else 'full'}", res, flops))
            print(rows[-1][0], {k: round(v, 4) for k, v in res.items()}, flush=True)
    return rows


def fmt_table(rows, variants):
    names = list(rows[0][1].keys())
    head = f"{'cell':<24}" + "".join(f"{n + ' ms':>11}" for n in names) + f"{'gluon TF/s':>11}{'best SDPA TF/s':>15}"
    lines = [head]
    for cell, res, flops in rows:
        best_sdpa = min(x for x in (res.get("flash", float("nan")), res.get("cudnn", float("nan"))) if x == x) \
            if any(res.get(n, float("nan")) == res.get(n, float("nan")) for n in ("flash", "cudnn")) else float("nan")
        tf = flops / (res["gluon"] * 1e-3) / 1e12
        stf = flops / (best_sdpa * 1e-3) / 1e12
        lines.append(f"{cell:<24}" + "".join(f"{res[n]:>11.3f}" for n in names) + f"{tf:>11.0f}{stf:>15.0f}")
    if variants:
        lines.append("variants D128: " + "; ".join(f"v{i}={c}" for i, c in enumerate(variant_cfgs(128))) +
                     " | D64: " + "; ".join(f"v{i}={c}" for i, c in enumerate(variant_cfgs(64))))
    return "\n".join(lines)


LOG = []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--variants", action="store_true")
    args = ap.parse_args()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    if args.smoke:
        for D, causal in ((128, False), (64, True)):
            t0 = time.time()
            ok, err, serr, lerr, tol = check_case(2, 16, 1000, 1000, D, causal, torch.bfloat16)
            print(f"smoke D{D} causal={causal}: {'ok' if ok else 'FAIL'} err={err:.2e} sdpa_err={serr:.2e} "
                  f"lse_err={lerr:.1e} ({time.time() - t0:.1f}s)", flush=True)
        return
    summary, n_fail = ("correctness: skipped", 0)
    if not args.no_check:
        summary, n_fail = run_checks(args)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "check_log.txt"), "w") as f:
            f.write("\n".join(LOG) + "\n")
    table = ""
    if not args.no_bench:
        rows = bench(args)
        table = fmt_table(rows, args.variants)
    print("\n==== summary (H100, bf16 for timings, do_bench medians) ====")
    print(summary)
    if table:
        print(table)
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
