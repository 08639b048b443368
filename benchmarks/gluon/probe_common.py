"""What gluon_fwd_probe.py and gluon_bwd_probe.py share: applying a patch table's text edits to a
rendered kernel, building a plan with plan patches, timing a cell's kernels in turn, and the
closing table."""
import contextlib
import dataclasses

import torch

from attncc.tiles import Tiles


# patches that are edits of the plan (dataclasses.replace) rather than of the rendered text
PLAN_PATCHES = {
    # masked steps evaluate the printed mask (mods' "keep") and the length checks, not compares with row ends
    "mask-expr": {"row_keep": None},
    # the forward's row max as Triton's one chain per row, P rounded one by one (before the tree)
    "max-chain": {"row_max_tree": False, "probs_in_pairs": False},
    # the forward under GQA with one query head a tile (before plan.pack_gqa)
    "no-pack": {"pack_gqa": 1},
    # the forward's masked steps compare kv_idx with the row's ends (before plan.lane_compares)
    "mask-kv": {"lane_compares": False},
    # ... and relative to the thread's first key with two warp groups too (measured slower at 16k)
    "mask-lane": {"lane_compares": True},
    # the forward's plan built with three / two consumer warp groups at head dim 64 (gluon_fwd_probe.py)
    "wide": {},
    "narrow": {},
    "split-bias": {},
    "no-split-bias": {},
    # the backward with query tiles of 64 where the plan takes 128 (head dim 64), and of 128 where it takes 64
    "bwd-m64": {"tiles": {"attn_bwd": Tiles(64, 64, 4, 2)}},
    "bwd-m128": {"tiles": {"attn_bwd": Tiles(128, 64, 4, 2)}},
}


def plan_edits(patch):
    """The plan fields `patch` replaces before rendering."""
    return {k: v for part in patch.split("+") for k, v in PLAN_PATCHES.get(part, {}).items()}


def build_plan(kind, variant, spec, patch=""):
    """plan.build's KernelPlan with the plan patches in `patch`: `wide` / `narrow` build it with three
    / two consumer warp groups at head dim 64 whatever tiles.wide_forward says, `split-bias` /
    `no-split-bias` with plan.SPLIT_BIAS on / off (the backward's separable bias in S^T's start), the
    others replace fields."""
    from unittest import mock

    from attncc import plan, tiles
    parts = patch.split("+")
    with contextlib.ExitStack() as patches:
        if {"wide", "narrow"} & set(parts):
            wide = "wide" in parts
            patches.enter_context(mock.patch.object(tiles, "wide_forward", lambda facts, mask_class, d: wide and d == 64))
        if {"split-bias", "no-split-bias"} & set(parts):
            patches.enter_context(mock.patch.object(plan, "SPLIT_BIAS", "split-bias" in parts))
        built = plan.build(kind, variant.analysis, spec, variant.captures)
    return dataclasses.replace(built, **plan_edits(patch))


def compiler(patch):
    """While a `ptxas=PATH` patch's kernel compiles: the ptxas at PATH (another CUDA's, or Triton's
    own), its cubins in a Triton cache folder of their own (attncc.toolchain.compiling, as attncc
    compiles the Gluon backward). Other patches: nothing."""
    paths = [part[len("ptxas="):] for part in patch.split("+") if part.startswith("ptxas=")]
    if not paths:
        return contextlib.nullcontext()
    from attncc import toolchain
    return toolchain.compiling(toolchain.choose(paths[-1], None))


def ptx_options(part, text):
    """`ptxopt=A:B`: the main kernel (the Gluon backward's attn_bwd, the forward's attn_fwd) compiled
    with ptxas options "A B" in place of the module's own (Triton's ptx_options, a compile option and
    so part of its cache key), e.g. ptxopt=--register-usage-level=0; `ptxopt=` with none."""
    options = part[len("ptxopt="):].replace(":", " ")
    value = f'"{options}"' if options else "None"
    if "ptx_options=PTXAS_OPTIONS," in text:  # the backward's launch passes the module's PTXAS_OPTIONS
        return [("ptx_options=PTXAS_OPTIONS,", f"ptx_options={value},")]
    anchor = "PACK=PACK, DYNAMIC=dynamic,"  # the forward's launch, which passes none
    return [(anchor, f"{anchor} ptx_options={value},")] if anchor in text else []


def sparse_lists(module, variant, spec, captures, B, H, N, device):
    """A data-dependent mask's tile lists for `module` (attncc.blocks), as a call makes them; None
    for the other masks."""
    if not module.BLOCK_SPARSE:
        return None
    import attncc
    from attncc import blocks
    classifier = attncc.compile(variant).classifier(spec)
    return blocks.for_module(module, classifier, captures, B, H, N, N, classifier.CLASS_PER_HEAD, device)


def apply(text, patch, table, optional=()):
    """text with the edits of `patch` ("a+b" joins table entries) applied; an old text that does not
    occur stops the probe, unless it starts with one of `optional` (a flag the render may have set)."""
    parts = [part for part in patch.split("+") if part not in PLAN_PATCHES and not part.startswith("ptxas=")]
    edits = [ptx_options(part, text) if part.startswith("ptxopt=") else table[part] for part in parts]
    for old, new in [edit for part in edits for edit in part]:
        if old in text:
            text = text.replace(old, new)
        elif not old.startswith(tuple(optional)):
            raise SystemExit(f"patch {patch}: text not found: {old!r}")
    return text


def peer_fn(system, case, N):
    """fn(q, k, v) of one of bench.py's systems (fa4, flex-flash, ...) for the case, or None where
    it cannot express it: timed in turn with the patched kernels, so that a patch's effect reads
    against the peer it must beat, not against a separate run's figure (the same cell moved by up
    to 9 % between bench runs an hour apart on one H100)."""
    import bench
    import torch._functorch.config
    torch._functorch.config.donated_buffer = False  # its backward is timed through a kept graph
    return bench.build(system, case, N)


def time_cell(label, fns, errors, rounds, rep):
    """Medians of do_bench over `rounds` turns of every kernel of a cell (fns["triton"] is the
    baseline), printed with each patch's error: (the baseline's ms, {patch: ms}). The kernels are
    timed in turn because the clock moves with the power draw: the kernel timed last in a round of
    long measurements read up to 10 % slow (H200, six patches of the backward, seventeenth session),
    and the same kernel under three names 6 % apart (nineteenth session). So a round is four short
    measurements of each kernel (rep / 4 ms), in order and then in reverse (A B C C B A ...), which
    takes a drift that is linear over the round out of every kernel's median alike."""
    import statistics

    from triton.testing import do_bench
    samples = {key: [] for key in fns}
    keys = list(fns)
    for r in range(rounds):
        for turn in range(4):
            for key in (keys if turn % 2 == 0 else keys[::-1]):
                samples[key].append(do_bench(fns[key], warmup=5, rep=max(rep // 4, 10), return_mode="median"))
    times = {key: statistics.median(ts) for key, ts in samples.items()}
    tri = times.pop("triton")
    print(label, f"triton {tri:.3f}", " ".join(f"{k} {t:.3f} ({errors[k]:.0e})" for k, t in times.items()), flush=True)
    return tri, times


def print_table(rows, patches, what, notes=()):
    """rows: (variant, shape, baseline ms, {patch: ms}, {patch: error}) per cell."""
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {what} ms (do_bench median)\n")
    for line in notes:
        print(line)
    print("| variant | shape | triton tier | " + " | ".join(patches) + " |")
    print("|---|---|--:|" + "--:|" * len(patches))
    nan = float("nan")  # a peer that cannot express the cell
    for name, shape, tri, times, errors in rows:
        print(f"| {name} | {shape} | {tri:.3f} | "
              + " | ".join(f"{times.get(p, nan):.3f} ({errors.get(p, nan):.0e})" for p in patches) + " |")
