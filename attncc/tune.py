"""Autotuning (ATTNCC_AUTOTUNE=1): the first call of a kernel under a new key times a few
candidate configurations on the call's own inputs and keeps the fastest, in process and in a
JSON file per GPU in the kernel cache folder, so that later calls and processes do not tune again.

    key        the kernel ("fwd" or "bwd"), the variant's IR, its Spec (dtype, head dims, GQA
               group, dropout, learnable captures, ...), attncc's code, and a size class: B*H,
               Lq and Lkv rounded up to powers of two
    candidate  the Spec fields that change the generated kernel: tiles (block_m, block_n,
               num_warps, num_stages) per kernel function and, on Hopper, whether the forward
               reads K/V through TMA and whether it warp-specialises; the first candidate is
               attncc's measured table (attncc.tiles.choose_tiles), unchanged
    check      a candidate's outputs must match the table's outputs on the same inputs within
               the dtype's tolerance; one that disagrees, fails to compile or runs out of shared
               memory is logged and dropped, never chosen
    file       an entry is used only when its choice is one of the candidates the tuner has for
               that kernel (valid_choice); any other (a file edited by hand or damaged) is logged
               and the call runs the table; a file that does not parse is measured again

A kernel call has no side effects on its inputs (outputs and gradient buffers are allocated per
call), so candidates run on the caller's tensors as they are. The timing is Triton's do_bench
(median, L2 flushed) on a GPU; the interpreter times one run (CPU tests).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import reprlib
import time
from pathlib import Path

import torch

from . import cache
from .log import logger

stats = {"tuned": 0, "file_hits": 0}  # for tests and logs
_chosen: dict = {}   # (IR key, kernel, Spec, size class) -> the Spec to run
_tables: dict = {}   # tuning file -> its entries, as read or written by this process

# relative disagreement a candidate's outputs may have with the table default's: twice what the
# tests allow between a kernel and the float64 reference (tests/conftest.py)
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3.2e-2}

# Tile candidates per (kernel, head dim class), the table's choice excluded (it always runs
# first). Backward: (dK/dV tiles with the launch's warps and stages, dQ tiles). From the H200
# sweeps (benchmarks/tile_sweep.py, benchmarks/tune_sweep.py): shapes that won somewhere or came
# within a few percent. Left out after measuring: 128x64 forward tiles with 4 warps at head dim
# 128 (1.7-2.3x slower), 32x128 dK/dV tiles with 4 warps at 128 (2.6x slower), and warp-
# specialised tiles of 3 stages: 128x128 does not fit shared memory, and 128x64 gave wrong
# results on triton 3.6 (the tuner's check dropped it; the table uses 2 stages).
_FWD = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3)],
    128: [(128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3)],
    256: [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 3), (32, 32, 4, 2)],
}
_FWD_WS = [(128, 64, 4, 2)]
_BWD = {
    64: [((32, 128, 4, 3), (64, 64)), ((32, 64, 4, 3), (64, 64)), ((64, 64, 4, 3), (64, 64)),
         ((64, 128, 8, 3), (128, 64)), ((32, 64, 4, 4), (64, 64))],
    128: [((64, 128, 8, 2), (128, 64)), ((64, 64, 4, 3), (64, 64)), ((32, 128, 8, 3), (128, 32)),
          ((64, 128, 8, 3), (64, 128))],
    256: [((32, 64, 4, 1), (64, 32)), ((32, 32, 4, 2), (32, 32)), ((16, 64, 4, 2), (64, 16))],
}
_INTERPRETER = {"fwd": [{"tiles": {"attn_fwd": (32, 64, 1, 1)}}],
                "bwd": [{"tiles": {"attn_bwd_dkdv": (32, 64, 1, 1), "attn_bwd_dq": (64, 32, 1, 1)}}]}


def _ceil_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def size_class(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """(B*H, Lq, Lkv), each rounded up to a power of two: calls of one class share a choice."""
    B, H, Lq = q.shape[:3]
    return _ceil_pow2(B * H), _ceil_pow2(Lq), _ceil_pow2(k.shape[2])


def tuned_spec(compiled, kernel: str, spec, run, q: torch.Tensor, k: torch.Tensor):
    """The Spec to run ``kernel`` under: ``spec`` with the measured-fastest choice of its key,
    from this process, the tuning file, or a new measurement (``run(module)`` runs a module)."""
    cls = size_class(q, k)
    memo = (compiled.variant.ir_key, kernel, spec, cls)
    chosen = _chosen.get(memo)
    if chosen is None:
        chosen = _chosen[memo] = _lookup_or_tune(compiled, kernel, spec, run, cls, q.device)
    return chosen


def table_path(target: str, device: torch.device) -> Path:
    """One JSON file per GPU model (the interpreter has its own) in this attncc/Triton folder."""
    name = "interpreter" if target == "interpreter" else torch.cuda.get_device_name(device)
    return cache.folder() / "tuning" / (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ".json")


def _entry_key(kernel, ir_key, spec, cls) -> str:
    text = repr((kernel, ir_key, spec, cls, cache._code_hash()))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _lookup_or_tune(compiled, kernel, spec, run, cls, device):
    path = table_path(spec.target, device)
    key = _entry_key(kernel, compiled.variant.ir_key, spec, cls)
    entry = _table(path).get(key)
    if entry is not None:
        default = compiled.module(kernel, spec)
        choice = valid_choice(entry, kernel, spec, default)
        if choice is None:
            logger.warning("autotune: ignoring entry %s of %s: %s is none of the tuner's candidates for %s of %s "
                           "(%s); running attncc's table. Delete the entry or the file to tune again",
                           key, path, reprlib.repr(entry.get("choice") if isinstance(entry, dict) else entry),
                           kernel, compiled.variant, "; ".join(map(str, candidates(kernel, spec, default))))
            return spec
        stats["file_hits"] += 1
        logger.debug("autotune: %s of %s from %s: %s", kernel, compiled.variant, path, choice)
        return apply(spec, choice)
    try:
        entry = measure(compiled, kernel, spec, run, candidates(kernel, spec, compiled.module(kernel, spec)))
    except Exception as e:  # triton's OutOfResources (imported lazily): with_fallback shrinks the tiles
        if type(e).__name__ != "OutOfResources":
            raise
        logger.info("autotune: the table's tiles of %s do not fit this GPU; not tuned", kernel)
        return spec
    entry.update(kernel=kernel, variant=repr(compiled.variant), spec=repr(spec),
                 size_class={"B*H": cls[0], "Lq": cls[1], "Lkv": cls[2]})
    _save(path, key, entry)
    stats["tuned"] += 1
    return apply(spec, entry["choice"])


def apply(spec, choice: dict):
    """``spec`` with a candidate's fields: {"tiles": {fn: [bm, bn, warps, stages]}, "tma": ..., "ws": ...}."""
    tiles = tuple(sorted((fn, tuple(int(x) for x in t)) for fn, t in choice.get("tiles", {}).items()))
    if any(len(t) != 4 for _, t in tiles):
        raise ValueError(f"tiles need (block_m, block_n, num_warps, num_stages): {choice}")
    extra = {f: choice[f] for f in ("tma", "ws") if f in choice}
    if any(m not in ("on", "off", "auto") for m in extra.values()):
        raise ValueError(f"tma / ws must be on, off or auto: {choice}")
    return dataclasses.replace(spec, tiles=tiles, **extra) if tiles or extra else spec


def valid_choice(entry, kernel: str, spec, default) -> dict | None:
    """The candidate (``candidates``) that a tuning file's entry chose, None when the entry
    chose nothing the tuner could have chosen for this kernel: a file edited by hand or damaged
    (a negative or zero tile, a tile that is no power of two, null) never reaches a kernel."""
    if not isinstance(entry, dict):
        return None
    try:
        text = json.dumps(entry.get("choice"), sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return None
    for c in candidates(kernel, spec, default):
        if json.dumps(c, sort_keys=True) == text:  # exact: 64.0 or true in place of 64 or 1 differ
            return c
    return None


def candidates(kernel: str, spec, default) -> list:
    """Choices to time, the table's own ({}) first. ``default`` is the module the table gives,
    whose LAUNCH_TILES / TMA / WARP_SPECIALIZED say what the table chose."""
    if spec.target == "interpreter":
        return [{}] + _INTERPRETER[kernel]
    d = max(spec.head_dim, spec.head_dim_v)
    dclass = 64 if d <= 64 else 128 if d <= 128 else 256
    if spec.dtype == "float32":
        dclass = 256  # float32 tiles are twice the bytes: the small ones
    out = [{}]
    if kernel == "bwd":
        for (m1, n1, warps, stages), (m2, n2) in _BWD[dclass]:
            out.append({"tiles": {"attn_bwd_dkdv": (m1, n1, warps, stages), "attn_bwd_dq": (m2, n2, warps, stages)}})
        return out
    if getattr(default, "WARP_SPECIALIZED", False):
        out += [{"tiles": {"attn_fwd_ws": t}} for t in _FWD_WS]
        out.append({"ws": "off"})  # the pointer loop with the table's tiles
        return out
    out += [{"tiles": {"attn_fwd": t}} for t in _FWD[dclass]]
    if spec.tma != "off":  # the layout allows descriptors: try the other way of reading K/V
        out.append({"tma": "off" if default.TMA else "on"})
    return out


def measure(compiled, kernel: str, spec, run, choices: list) -> dict:
    """Run and time each choice; the fastest whose outputs match the first choice's wins.
    Returns {"choice", "ms", "default_ms", "tried": [{"choice", "ms" or "error"}]}."""
    tried, seen, reference, best = [], set(), None, None
    tol = TOLERANCE[spec.dtype]
    for i, choice in enumerate(choices):
        try:
            module = compiled.module(kernel, apply(spec, choice))
            signature = (repr(getattr(module, "LAUNCH_TILES", None)), getattr(module, "TMA", None),
                         getattr(module, "WARP_SPECIALIZED", None))
            if signature in seen:
                continue  # the same kernel as an earlier choice
            seen.add(signature)
            result = _flat(run(module))  # compiles; the check compares this first run
            if reference is None:
                reference = result
            else:
                err = disagreement(result, reference)
                if not err <= tol:
                    raise ValueError(f"outputs differ from the table default's by {err:.3g} (tolerance {tol:g})")
            ms = _time(lambda: run(module), spec.target == "interpreter")
        except Exception as e:
            if i == 0:
                raise  # the table default must run (with_fallback shrinks it if it does not fit)
            logger.warning("autotune: %s candidate %s of %s dropped: %s: %s", kernel, choice, compiled.variant,
                           type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
            tried.append({"choice": choice, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        tried.append({"choice": choice, "ms": ms})
        if best is None or ms < best[1]:
            best = (choice, ms)
    default_ms = tried[0]["ms"]
    logger.info("autotuned %s of %s: %s at %.4f ms (table default %.4f ms, %d candidates)", kernel,
                compiled.variant, best[0] or "the table default", best[1], default_ms, len(tried))
    return {"choice": best[0], "ms": best[1], "default_ms": default_ms, "tried": tried}


def _flat(result) -> list:
    out = []
    for r in result if isinstance(result, (tuple, list)) else (result,):
        out += _flat(r) if isinstance(r, (tuple, list)) else [r]
    return out


def disagreement(a: list, b: list) -> float:
    """max over output tensors of ||a - b|| / ||b|| in float64 (equal infinities agree, as the
    -inf lse of fully masked rows); inf for a NaN, a shape mismatch or a missing output."""
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return float("inf")
        x, y = x.detach().double(), y.detach().double()
        if torch.isnan(x).any() or torch.isnan(y).any():
            return float("inf")
        diff = torch.where(x == y, torch.zeros_like(x), x - y)
        if not torch.isfinite(diff).all():
            return float("inf")
        den = torch.where(torch.isfinite(y), y, torch.zeros_like(y)).norm().item()
        num = diff.norm().item()
        worst = max(worst, num / den if den > 0 else num)
    return worst


def _time(fn, interpret: bool) -> float:
    """Milliseconds of one call: do_bench's median on a GPU, one timed run in the interpreter."""
    if interpret:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def _table(path: Path) -> dict:
    table = _tables.get(path)
    if table is None:
        table = _tables[path] = _read(path)
    return table


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
        return data["entries"]
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
        logger.warning("autotune: cannot read %s (%s: %s); its entries are measured again", path,
                       type(e).__name__, e)
        return {}


def _save(path: Path, key: str, entry: dict) -> None:
    """Add one entry to the file, keeping what other processes wrote there since it was read."""
    table = _table(path)
    table.update({k: v for k, v in _read(path).items() if k not in table})
    table[key] = entry
    try:
        cache._write(path, json.dumps({"format": 1, "entries": table}, indent=1, sort_keys=True) + "\n")
    except OSError as e:  # a read-only cache folder: the choice holds for this process only
        logger.warning("autotune: cannot write %s (%s)", path, e)
