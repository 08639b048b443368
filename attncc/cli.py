"""The attncc command line: ``attncc COMMAND`` or ``python -m attncc COMMAND``.

show / explain / bench take FILE.py:NAME, a variant or mod defined in a Python file; demo runs
examples/demo.py; cache lists or empties the kernel cache. A bad argument, and any AttnccError
from the library, is one line ``attncc: error: ...`` on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import runpy
import statistics
import sys
from pathlib import Path

import torch

from . import __version__, api, cache, config, inference, ir, plan, reference, runtime
from .checks import check_index_ranges
from .errors import AttnccError
from .variant import Variant

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BENCH_DEVICE = "cuda"
TILE_CHARS = ".+#"  # tile class 0 empty, 1 partial, 2 full
MOD_PARAMS = {"score_mod": ("score", "b", "h", "q_idx", "kv_idx"), "mask_mod": ("b", "h", "q_idx", "kv_idx")}
TARGET_HELP = ("a Python file and a name it defines: an attncc.Variant, a CompiledAttention, a score_mod or a "
               "mask_mod; FILE.py:score_fn+mask_fn joins two mods")


class UsageError(Exception):
    """A bad command line: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), raised for main() to print."""

    def error(self, message):
        raise UsageError(message)


# ---------------------------------------------------------------- FILE.py:NAME

def _run_file(path: Path) -> dict:
    """The globals of a Python file run as a module (not as __main__, so its `if __name__ ==
    '__main__'` block stays off); what it prints goes to stderr, keeping stdout for our output."""
    spec = importlib.util.spec_from_file_location(f"attncc_cli_file_{path.stem}", path) if path.is_file() else None
    if spec is None:
        raise UsageError(f"no such Python file: {path}")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # its imports of files beside it
    try:
        with contextlib.redirect_stdout(sys.stderr):
            spec.loader.exec_module(module)
    except AttnccError:
        raise
    except Exception as e:
        raise UsageError(f"running {path} failed: {type(e).__name__}: {e}") from None
    return vars(module)


def _accepts(sig: inspect.Signature, n: int) -> bool:
    try:
        sig.bind(*range(n))
    except TypeError:
        return False
    return True


def _mod_kind(obj, name: str) -> str:
    """'score_mod' or 'mask_mod': IR expressions tell by their type, functions by which of
    FlexAttention's two signatures their parameters accept."""
    if isinstance(obj, ir.Node):
        return "mask_mod" if obj.type == ir.BOOL else "score_mod"
    if isinstance(obj, (Variant, api.CompiledAttention)):
        raise UsageError(f"{name} is a {type(obj).__name__}; only mod functions can be joined with '+'")
    if not callable(obj) or isinstance(obj, type):
        raise UsageError(f"{name} ({type(obj).__name__}) is not an attncc.Variant, a CompiledAttention, "
                         "a score_mod or a mask_mod")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        raise UsageError(f"cannot read the signature of {name}; wrap it in an attncc.Variant in the file") from None
    fits = [kind for kind, params in MOD_PARAMS.items() if _accepts(sig, len(params))]
    if len(fits) == 1:
        return fits[0]
    score, mask = (f"({', '.join(params)})" for params in MOD_PARAMS.values())
    problem = f"could be either a score_mod{score} or" if fits else f"is neither a score_mod{score} nor"
    raise UsageError(f"{name}{sig} {problem} a mask_mod{mask}; say which with "
                     "attncc.Variant(score_mod=..., mask_mod=...) in the file")


def load_target(target: str) -> api.CompiledAttention:
    """The CompiledAttention named by FILE.py:NAME (NAME may be 'score_fn+mask_fn')."""
    file, _, name = target.rpartition(":")
    if not file or not name:
        raise UsageError(f"expected FILE.py:NAME, got {target!r}; NAME is {TARGET_HELP.split(': ', 1)[1]}")
    namespace = _run_file(Path(file))
    parts = name.split("+")
    for part in (p for p in parts if p not in namespace):
        own = lambda v: getattr(v, "__module__", None) == namespace["__name__"]  # noqa: E731 (defined in the file)
        known = [k for k, v in namespace.items()
                 if not k.startswith("_") and (isinstance(v, (Variant, api.CompiledAttention, ir.Node)) or own(v))]
        raise UsageError(f"{file} defines no {part!r}; variants and mods defined there: {', '.join(known) or 'none'}")
    if len(parts) == 1 and isinstance(namespace[name], (Variant, api.CompiledAttention)):
        return api.compile(namespace[name]) if isinstance(namespace[name], Variant) else namespace[name]
    mods = {}
    for part in parts:
        kind = _mod_kind(namespace[part], part)
        if kind in mods:
            raise UsageError(f"{name} joins two {kind}s; join one score_mod and one mask_mod")
        mods[kind] = namespace[part]
    return api.compile(Variant(mods.get("score_mod"), mods.get("mask_mod"), name=name))


# ---------------------------------------------------------------- show, explain

def cmd_show(args):
    compiled = load_target(args.target)
    shape = (args.kernel, DTYPES[args.dtype], args.head_dim, args.head_dim_v, args.gqa)
    source = compiled.source(*shape)  # checks the arguments
    tier, why = compiled.tier(*shape)
    print(f"attncc show: the {tier} tier ({why})", file=sys.stderr)  # stdout is the source alone
    print(source, end="")


def default_tile(variant: Variant, length: int) -> tuple[int, int]:
    """(block_m, block_n) of the forward kernel at bfloat16 and head dim 128 on this GPU (sm90
    without one) for ``length`` queries and keys in (B, H, L, D) tensors: the tiles its loop
    skips or visits, as the generated launch picks them (the persistent kernel for whole tiles,
    under a mask up to ws_kv keys; else the short tiles of causal-like masks up to short_kv)."""
    target = runtime.target_for(torch.device("cuda")) if torch.cuda.is_available() else "cuda-sm90"
    kernel = plan.build("fwd", variant.analysis, plan.Spec("bfloat16", 128, 128, 1, target, tma="auto", ws="auto"),
                        variant.captures)
    ws = kernel.tiles.get("attn_fwd_ws")
    whole = ws is not None and length % ws.block_m == 0 and length % ws.block_n == 0
    if kernel.ws and whole and (not kernel.ws_kv or length <= kernel.ws_kv):
        return ws.block_m, ws.block_n
    fn = "attn_fwd_short" if length <= kernel.short_kv else "attn_fwd"
    return kernel.tiles[fn].block_m, kernel.tiles[fn].block_n


def _tiled(x: torch.Tensor, bm: int, bn: int, fill: bool) -> torch.Tensor:
    """x (rows, cols) padded with ``fill`` to whole tiles, viewed as (row tiles, bm, col tiles, bn)."""
    rows, cols = -(-x.shape[0] // bm) * bm, -(-x.shape[1] // bn) * bn
    out = torch.full((rows, cols), fill, dtype=torch.bool)
    out[:x.shape[0], :x.shape[1]] = x
    return out.view(rows // bm, bm, cols // bn, bn)


def tile_classes(variant: Variant, length: int, bm: int, bn: int) -> torch.Tensor:
    """int8 (query tiles, key tiles) of the mask at batch 0, head 0: 0 empty, 1 partial, 2 full.

    The mask is evaluated densely on the CPU by the reference's IR evaluator, a band of query
    rows at a time; positions past ``length`` do not count, as in the kernels. A captured tensor
    too small for ``length`` raises the AttnccError a kernel call of that length raises."""
    check_index_ranges(variant, {"b": (0, 0), "h": (0, 0), "q_idx": (0, length - 1), "kv_idx": (0, length - 1)},
                       (1, 1, length, length))
    if variant.mask_ir is None:
        return torch.full((-(-length // bm), -(-length // bn)), 2, dtype=torch.int8)
    band, out = bm * max(1, 2**22 // (bm * length)), []
    for r0 in range(0, length, band):
        q_idx = torch.arange(r0, min(length, r0 + band)).view(-1, 1)
        env = {"b": torch.tensor(0), "h": torch.tensor(0), "q_idx": q_idx, "kv_idx": torch.arange(length).view(1, -1)}
        keep = reference.evaluate(variant.mask_ir, env, torch.float32, "cpu").expand(len(q_idx), length)
        some = _tiled(keep, bm, bn, False).any(dim=3).any(dim=1)
        every = _tiled(keep, bm, bn, True).all(dim=3).all(dim=1)
        out.append(torch.where(every, 2, torch.where(some, 1, 0)).to(torch.int8))
    return torch.cat(out)


def save_png(classes: torch.Tensor, path: Path, title: str) -> None:
    """The tile classes as an image (needs matplotlib, the 'plot' extra)."""
    try:
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise UsageError("--mask-png needs matplotlib: pip install 'attncc[plot]'") from None
    colors, names = ["#f2f2f2", "#f4a259", "#2a6f97"], ["empty (skipped)", "partial", "full"]
    ax = Figure(figsize=(6.4, 6.4)).subplots()
    ax.imshow(classes.numpy(), cmap=ListedColormap(colors), vmin=0, vmax=2, interpolation="nearest")
    ax.set(xlabel="key tile", ylabel="query tile")
    ax.set_title(title, fontsize=9, wrap=True)
    ax.legend(handles=[Patch(color=c, label=n) for c, n in zip(colors, names)], loc="upper right", fontsize=8)
    ax.figure.savefig(path, dpi=120, bbox_inches="tight")


def cmd_explain(args):
    compiled = load_target(args.target)
    if args.mask_ascii or args.mask_png:
        bm, bn = args.tile or default_tile(compiled.variant, args.len)
        classes = tile_classes(compiled.variant, args.len, bm, bn)
        summary = (f"mask tiles of batch 0, head 0, length {args.len}, {bm}x{bn} tiles (rows: query tiles): "
                   "{} full, {} partial, {} empty".format(*[int((classes == c).sum()) for c in (2, 1, 0)]))
        if args.mask_png:  # before printing anything: it fails without matplotlib
            save_png(classes, args.mask_png, summary)
    print(compiled.explain())
    if args.mask_ascii:
        print(f"\n{summary} ('#' full, '+' partial, '.' empty):")
        print("\n".join("".join(TILE_CHARS[c] for c in row) for row in classes.tolist()))
    if args.mask_png:
        print(f"\nwrote {args.mask_png}: {summary}")


# ---------------------------------------------------------------- bench

def median_ms(fn, reps: int, warmup: int = 3, before=lambda: None) -> float:
    """Median milliseconds of fn() over ``reps`` calls after ``warmup``, timed with CUDA events;
    ``before()`` runs ahead of each call, outside the timed region."""
    events = []
    for i in range(warmup + reps):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if i >= warmup:
            events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _progress(done: int, total: int, label: str) -> None:
    bar = "#" * (24 * done // total)
    sys.stderr.write(f"\r[{bar:.<24}] {done}/{total} {label:<48}" + ("\n" if done == total else ""))
    sys.stderr.flush()


def _systems(compiled: api.CompiledAttention, args) -> list:
    """(label, make) per system; make(L) returns fn(q, k, v), or a string saying why there is none."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    v, gqa = compiled.variant, {"enable_gqa": True} if args.gqa > 1 else {}
    is_causal = v.analysis.mask == Variant(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).analysis.mask
    same = not v.dropout_p and v.analysis.facts.score_identity and (is_causal or v.analysis.facts.mask_trivial)

    def flex(L):
        if isinstance(v.score_mod, ir.Node) or isinstance(v.mask_mod, ir.Node) or v.dropout_p:
            return "n/a: FlexAttention takes mod functions and has no dropout"
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        torch._dynamo.reset()  # a fresh compile per length, away from dynamo's recompile limit
        fn = torch.compile(flex_attention, dynamic=False)
        bh = (args.batch, args.heads) if {"b", "h"} & set(v.analysis.facts.mask_reads) else (None, None)
        mask = v.mask_mod and create_block_mask(v.mask_mod, *bh, L, L, device=BENCH_DEVICE)
        return lambda q, k, val: fn(q, k, val, score_mod=v.score_mod, block_mask=mask, scale=v.scale, **gqa)

    def sdpa(q, k, val):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, val, is_causal=is_causal, scale=v.scale,
                                                                    **gqa)
    sdpa_label = f"SDPA flash, {'causal' if is_causal else 'no mask'}" + ("" if same else " (reference point only)")
    return [("attncc", lambda L: lambda q, k, val: compiled(q, k, val, **gqa)), ("FlexAttention (compiled)", flex),
            (sdpa_label, lambda L: sdpa)]


def _time_system(make, L, args) -> tuple:
    """(fwd ms, fwd+bwd ms or None, note) of one system at one length."""
    dtype, dv, kv_heads = DTYPES[args.dtype], args.head_dim_v or args.head_dim, args.heads // args.gqa
    randn = lambda h, d: torch.randn(args.batch, h, L, d, device=BENCH_DEVICE, dtype=dtype)  # noqa: E731
    q, k, val = randn(args.heads, args.head_dim), randn(kv_heads, args.head_dim), randn(kv_heads, dv)
    fn = make(L)
    if isinstance(fn, str):
        return None, None, fn
    with torch.no_grad():
        fwd = median_ms(lambda: fn(q, k, val), args.reps)
    if not args.backward:
        return fwd, None, ""
    leaves, grad_out = [t.requires_grad_() for t in (q, k, val)], randn(args.heads, dv)
    clear = lambda: [setattr(t, "grad", None) for t in leaves]  # noqa: E731
    return fwd, median_ms(lambda: fn(q, k, val).backward(grad_out), args.reps, before=clear), ""


def cmd_bench(args):
    if not torch.cuda.is_available():
        raise UsageError("bench needs a CUDA GPU (torch.cuda.is_available() is False); show and explain do not")
    if args.heads % args.gqa:
        raise UsageError(f"--heads {args.heads} is not a multiple of --gqa {args.gqa}")
    compiled = load_target(args.target)
    runs = [(L, system) for L in args.len for system in _systems(compiled, args)]
    rows = []
    for i, (L, (label, make)) in enumerate(runs):
        _progress(i, len(runs), f"{label}, length {L}")
        try:
            rows.append((L, label, *_time_system(make, L, args)))
        except AttnccError:
            raise
        except Exception as e:  # out of memory, a backend that refuses the shape or dtype, ...
            torch.cuda.empty_cache()
            rows.append((L, label, None, None, f"failed: {type(e).__name__}: {' '.join(str(e).split())[:80]}"))
    _progress(len(runs), len(runs), "done")
    base, ms = {r[0]: r[2:4] for r in rows if r[1] == "attncc"}, lambda x: "" if x is None else f"{x:.3f}"
    print(f"{args.target}: batch {args.batch}, {args.heads} heads (GQA {args.gqa}), head dim "
          f"{args.head_dim}, {args.dtype}, {torch.cuda.get_device_name()}; median of {args.reps} runs\n\n"
          "| length | system | fwd ms | fwd+bwd ms | time / attncc's (fwd · fwd+bwd) | note |\n"
          "|---:|---|---:|---:|---:|---|")
    for L, label, f, b, note in rows:
        ratios = [f"{x / y:.2f}×" for x, y in zip((f, b), base.get(L, (None, None))) if x and y]
        vs = " · ".join(ratios) if label != "attncc" else ""
        print(f"| {L} | {label} | {ms(f)} | {ms(b)} | {vs} | {note} |")


# ---------------------------------------------------------------- demo, cache

def cmd_demo(args):
    path = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
    if not path.is_file():
        raise UsageError(f"the demo is examples/demo.py of the attncc repository, which is not beside this "
                         f"installed package ({Path(__file__).resolve().parent}); run it from a clone")
    sys.path.insert(0, str(path.parent))  # its `from _common import ...`
    argv, sys.argv = sys.argv, [str(path)] + (["--full"] if args.full else [])
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = argv


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def cmd_cache(args):
    root = config.cache_dir()
    if args.action == "clear":
        n, size = cache.clear()
        print(f"removed {n} files ({_size(size)}) from {root}")
        return
    found = cache.entries()
    sources = [(p, s) for p, s in found if p.suffix == ".py"]
    for p, s in sources:
        print(f"{_size(s):>10}  {p.relative_to(root)}")
    print(f"{len(sources)} kernel sources and {len(found) - len(sources)} other files, "
          f"{_size(sum(s for _, s in found))}, in {root} (this version: {cache.folder().name})")


# ---------------------------------------------------------------- arguments

def _int_in(what: str, low: int = 1, high: int | None = None):
    """An argparse type: an integer in [low, high]."""
    def parse(text):
        if not text.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}")
        n = int(text)
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"{what} {n} is outside {low}..{high or 'any'}")
        return n
    return parse


def _tile(text: str) -> tuple[int, int]:
    sizes = text.lower().split("x")
    if len(sizes) > 2 or not all(s.isdigit() and int(s) > 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"tile must be BLOCK_MxBLOCK_N or one size, e.g. 64x64 or 32; got {text!r}")
    return int(sizes[0]), int(sizes[-1])


COMMANDS = {  # name: (function, help, example for the epilog)
    "show": (cmd_show, "print the generated Triton source of a variant",
             "attncc show examples/mods.py:softcap --kernel bwd --dtype fp16 --head-dim 64 > softcap_bwd.py"),
    "explain": (cmd_explain, "print the IR, simplified expressions, backward formulas and tile skipping",
                "attncc explain examples/mods.py:document --mask-ascii --len 2048\n\nThe tile picture shows batch 0, "
                "head 0: the mask is evaluated densely on the CPU, reading the tensors the file made. It shows\n"
                "the mask's exact tile classes; kernels of masks without tensors skip tiles by ranges derived\n"
                "from the formula (explain's 'Tile skipping'), which may count a few more tiles as partial."),
    "bench": (cmd_bench, "time a variant on the GPU against compiled FlexAttention and SDPA (flash)",
              "attncc bench examples/mods.py:alibi+causal --len 2048 4096 8192 --backward"),
    "demo": (cmd_demo, "run examples/demo.py (needs the repository)", "attncc demo --full"),
    "cache": (cmd_cache, "list or empty the kernel source cache ($ATTNCC_CACHE_DIR)",
              "attncc cache list\n  ATTNCC_CACHE_DIR=/tmp/kernels attncc cache clear"),
}


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="attncc", formatter_class=raw, description="attncc: FlexAttention-style mods compiled into "
                "FlashAttention Triton kernels.", epilog="example:\n  attncc show examples/mods.py:causal\n\n"
                "'attncc COMMAND --help' describes each command.")
    p.add_argument("--version", action="version", version=f"attncc {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cmd = {}
    for name, (run, text, example) in COMMANDS.items():
        cmd[name] = sub.add_parser(name, help=text, description=text, epilog=f"example:\n  {example}",
                                   formatter_class=raw)
        cmd[name].set_defaults(run=run)
        if name in ("show", "explain", "bench"):
            cmd[name].add_argument("target", metavar="FILE.py:NAME", help=TARGET_HELP)
    cmd["show"].add_argument("--kernel", choices=api.KERNELS, default="fwd", help="(default fwd)")
    for c in (cmd["show"], cmd["bench"]):
        c.add_argument("--dtype", choices=DTYPES, default="bf16", help="(default bf16)")
        # training kernels take head dims up to 256, the inference kernel (kv) up to 1024 / 512
        c.add_argument("--head-dim", type=_int_in("head dim", 1, inference.MAX_HEAD_DIM), default=128,
                       help="query/key head dim (default 128)")
        c.add_argument("--head-dim-v", type=_int_in("head dim", 1, inference.MAX_HEAD_DIM_V),
                       help="(default: --head-dim)")
        c.add_argument("--gqa", type=_int_in("GQA group"), default=1, help="query heads per K/V head (default 1)")
    explain = cmd["explain"]
    explain.add_argument("--mask-ascii", action="store_true", help="print the mask's tiles: '#' full, '+' partial, "
                         "'.' empty")
    explain.add_argument("--mask-png", type=Path, metavar="OUT.png", help="draw the mask's tiles (needs matplotlib)")
    explain.add_argument("--len", type=_int_in("length"), default=1024, help="length of the picture (default 1024)")
    explain.add_argument("--tile", type=_tile, help="BLOCK_MxBLOCK_N of the picture (default: the forward "
                         "kernel's at bf16, head dim 128)")
    bench = cmd["bench"]
    bench.add_argument("--len", type=_int_in("length"), nargs="+", default=[4096], help="(default 4096)")
    bench.add_argument("--batch", type=_int_in("batch"), default=4, help="(default 4)")
    bench.add_argument("--heads", type=_int_in("heads"), default=16, help="query heads (default 16)")
    bench.add_argument("--backward", action="store_true", help="also time forward + backward")
    bench.add_argument("--reps", type=_int_in("reps"), default=20, help="timed runs (default 20)")
    cmd["demo"].add_argument("--full", action="store_true", help="print the whole generated file")
    cmd["cache"].add_argument("action", choices=("list", "clear"))
    return p


def main(argv=None) -> int:
    """Run one command; returns the exit status (0, or 2 after a one-line error)."""
    try:
        args = build_parser().parse_args(argv)
        args.run(args)
    except (UsageError, AttnccError) as e:
        print("attncc: error: " + " ".join(line.strip() for line in str(e).splitlines() if line.strip()),
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # `attncc show ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
