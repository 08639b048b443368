"""Autotune attncc on the benchmark's variants and shapes (ATTNCC_AUTOTUNE=1) and report, per
cell and kernel, the time of attncc's table default against the tuner's choice: both measured by
the tuner, in one process, on the same inputs (attncc/tune.py). Writes
benchmarks/results/<gpu>-tuning.json (the cells and the tuner's whole entries).

    python benchmarks/tune_sweep.py                       # every variant and shape of bench.py
    python benchmarks/tune_sweep.py --only full,causal --shapes 4x16x4096x128
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import DEVICE, DTYPE, RESULTS, SHAPES, gpu_name  # noqa: E402
from report import fmt_shape  # noqa: E402
from variants import NAMES, make_cases  # noqa: E402


def tune_cell(case, shape) -> float:
    """One forward+backward of the variant under ATTNCC_AUTOTUNE=1 (tunes both kernels)."""
    import attncc
    B, H, N, D = shape
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, generator=g, device=DEVICE, dtype=DTYPE).requires_grad_()
               for h in (H, H // case.gqa, H // case.gqa))
    kernel = attncc.compile(attncc.Variant(case.score_mod, case.mask_mod, dropout_p=case.dropout_p))
    start = time.perf_counter()
    kernel(q, k, v, enable_gqa=case.gqa > 1).backward(torch.randn(B, H, N, D, device=DEVICE, dtype=DTYPE))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(NAMES), help="variants, comma-separated")
    p.add_argument("--shapes", default=",".join(fmt_shape(s) for s in SHAPES), help="BxHxNxD list")
    p.add_argument("--cache-dir", default=None, help="ATTNCC_CACHE_DIR (default: a fresh temporary folder)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    os.environ["ATTNCC_AUTOTUNE"] = "1"
    os.environ["ATTNCC_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="attncc-tune-")
    from attncc import tune
    names = [n for n in args.only.split(",") if n]
    cells = []
    for shape in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        for name in names:
            case = make_cases(shape[1], shape[2], DEVICE)[name]
            path = tune.table_path("cuda", torch.device(DEVICE))
            before = set(tune._table(path))
            seconds = tune_cell(case, shape)
            for key, e in tune._table(path).items():
                if key in before:
                    continue
                cells.append(dict(variant=name, shape=fmt_shape(shape), kernel=e["kernel"], default_ms=e["default_ms"],
                                  tuned_ms=e["ms"], speedup=e["default_ms"] / e["ms"], choice=e["choice"],
                                  dropped=[t["choice"] for t in e["tried"] if "error" in t], key=key))
                c = cells[-1]
                print(f"{name:22s} {c['shape']:16s} {c['kernel']:4s} table {c['default_ms']:8.4f} ms  tuned "
                      f"{c['tuned_ms']:8.4f} ms  {c['speedup']:5.3f}x  {json.dumps(c['choice'])}  "
                      f"({len(c['dropped'])} dropped, {seconds:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = gpu_name()
    target = out / f"{gpu.lower().replace(' ', '-')}-tuning.json"
    import attncc
    import triton
    env = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, attncc=attncc.__version__,
               date=time.strftime("%Y-%m-%d %H:%M"))
    target.write_text(json.dumps({"environment": env, "cells": cells,
                                  "entries": tune._table(tune.table_path("cuda", torch.device(DEVICE)))},
                                 indent=1, default=str) + "\n")
    print("\n| variant | shape | kernel | table ms | tuned ms | speedup | choice |\n|---|---|---|---|---|---|---|")
    for c in cells:
        print(f"| {c['variant']} | {c['shape']} | {c['kernel']} | {c['default_ms']:.4f} | {c['tuned_ms']:.4f} | "
              f"{c['speedup']:.3f}x | {json.dumps(c['choice'])} |")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
