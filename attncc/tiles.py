"""The measured speed choices of the generated kernels: tile shape, warps and pipeline depth per
kernel function (choose_tiles, from a table measured on an H200 with benchmarks/tile_sweep.py and
tune_sweep.py), and where the forward reads through tensor descriptors (tma_pays), runs the
persistent warp-specialised kernel (ws_fits, ws_pays, and under a mask up to ws_kv keys) or
launches short tiles for few keys (short_kv). Each rule quotes the measurement it came from;
attncc.plan puts the choices into a KernelPlan."""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import config
from .log import logger
from .passes.symbolic import KV, Q
from .spec import Spec


@dataclass(frozen=True)
class Tiles:
    """One kernel function's tile (block_m rows of the outer loop, block_n of the inner one), warps
    and software-pipeline stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def gluon_tiles(kernel: str, spec: Spec, dscore_one: bool = True, whole_tiles: bool = True,
                three_groups: bool = False, gathers: bool = False) -> dict:
    """The Gluon kernels' tiles (templates/sm90). Forward: 64 query rows per consumer warp group,
    key tiles of 128, two K/V stages at head dim 128 and three at 64, as measured
    (benchmarks/gluon/NOTES.md: three stages at 128 and key tiles of 64 were slower); two consumer
    warp groups (num_warps 8), or three (12: FA3/FA4's 192-row tile) with ``three_groups``, which
    wide_forward grants at head dim 64 where their 160 registers hold the softmax (H100,
    1x32x16384x64 against two: full 4.63 vs 5.00 ms, causal 2.35-2.55 vs 2.63-3.02; ALiBi 4.45
    vs 3.13, spilling).
    Backward (FA3's sm90 shapes): 64 K/V rows per consumer warp group (two per program), two
    Q/dO stages, query tiles of 64 at head dim 128 and of 128 at 64 (whose dK and dV accumulators
    leave the registers for it) where the score_mod's derivative is 1 (``dscore_one``) and the
    mask leaves some tiles whole (``whole_tiles``). A dscore tile beside the 128-row S^T and dP^T
    spills (softcap: 360 bytes of stack per thread, 0.64x the Triton tier on an H100, against none
    with tiles of 64), and so does the mask code of 128-row steps (causal: 104 bytes): a mask
    whose tile bounds leave no whole tile runs every step with it (H100, a document mask,
    4x32x4096x64 / 1x32x16384x64: 3.049 / 10.936 ms with tiles of 128, 2.399 / 8.561 with 64;
    causal 1.757 / 5.979 against 1.823 / 6.204). So does a table gathered per score (``gathers``,
    gathers_per_entry(both=True): the relative bias's 128-row step spilled 34-62 words a thread, 105-174 with
    its table learnable; H200, causal relative bias 4x32x4096x64 / 1x32x16384x64, 128 against 64:
    3.78 / 13.84 ms against 2.19 / 7.75, learnable 6.69 / 23.9 against 3.46 / 12.9; ALiBi, whose
    bias is computed, keeps 128: 1.905 / 6.319 against 1.908 / 6.821)."""
    if kernel == "bwd":
        wide = spec.head_dim <= 64 and dscore_one and whole_tiles and not gathers
        return {"attn_bwd": Tiles(128 if wide else 64, 64, 4, 2)}
    return {"attn_fwd": Tiles(64, 128, 12 if three_groups else 8, 2 if spec.head_dim > 64 else 3)}


def wide_forward(facts, mask_class: str, head_dim: int) -> bool:
    """Whether the Gluon forward runs three consumer warp groups of 64 query rows (gluon_tiles):
    at head dim 64, where the softmax (one exp2 per score) weighs as much as the tile products,
    with the identity score_mod and a mask that does not band the keys. With 160 registers each,
    other mods and a banded mask's code spill (H100, 1x32x16384x64, ms with three / two:
    ALiBi 4.45 / 3.13, sliding window 0.83 / 0.52), and a mask that reads captured tensors (a document
    mask: 368 bytes of stack, sm90, triton 3.6). Sliding window and softcap no longer spill in the
    key loops and are still slower (H200, 2026-11-29, gluon_fwd_probe.py `wide`, 4x32x4096x64, ms
    with two / three: sliding window 0.377 / 0.449, softcap 0.926 / 1.275, ALiBi 0.857 / 1.537)."""
    return head_dim == 64 and facts.score_identity and mask_class != "banded" and not facts.captures_in_mask


def packs_gqa(facts, mask_class: str, head_dim: int, group: int, offsets: bool) -> bool:
    """Whether the Gluon forward packs a GQA group's query heads into a tile's rows (pack_gqa): with
    three consumer warp groups (head dim 64), mods that do not read h and a group dividing 64. H200,
    in turn (benchmarks/gluon/gluon_fwd_probe.py, 2026-11-28), GQA 4:1 causal ms packed / one head a
    tile: head dim 64 4x32x4096 0.631 / 0.678, 1x32x16384 2.163 / 2.242, 8x32x2048 0.370 / 0.410;
    head dim 128 (two warp groups, 16 positions of 4 heads each) 4x16x4096 0.494 / 0.482,
    1x16x16384 1.783 / 1.740, 16x16x1024 0.177 / 0.171: not there."""
    return (group > 1 and 64 % group == 0 and not offsets and wide_forward(facts, mask_class, head_dim)
            and "h" not in facts.mask_reads)


def pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def split_dim(n: int) -> tuple:
    """A head dim as two power-of-two pieces (the second 0 when one suffices): 576 -> (512, 64),
    80 -> (64, 16); the inference kernel loads and dots them separately instead of padding."""
    if n <= 16 or n & (n - 1) == 0:
        return pow2(n), 0
    first = 1 << (n.bit_length() - 1)
    return first, pow2(n - first)


def choose_tiles(fn: str, spec: Spec, sparse: bool = False, mask_class: str = "none") -> Tiles:
    """Tile shape, warps and pipeline depth for one kernel function on a target; each level of
    ``spec.shrink`` drops a pipeline stage, then halves the streamed tile. ``mask_class``:
    "none" (no mask), "masked", or "banded" (each query row reaches a bounded key range, like a
    sliding window)."""
    measured = dict(spec.tiles).get(fn)  # the autotuner's pick (attncc.tune) replaces the rules
    t = Tiles(*measured) if measured else _base_tiles(fn, spec)
    override = bool(config.tile_overrides().get(fn))
    why = ("autotuned (ATTNCC_AUTOTUNE)" if measured else "interpreter default" if spec.target == "interpreter"
           else "ATTNCC_TILES override" if override else "default table")
    tuned = spec.target != "interpreter" and spec.dtype != "float32" and not override and not measured
    fwd, bwd = fn == "attn_fwd", fn in ("attn_bwd_dkdv", "attn_bwd_dq")
    d = max(pow2(spec.head_dim), pow2(spec.head_dim_v))
    if tuned and sparse and ((fwd and t.block_n == 128) or (bwd and d == 128)):
        # data-dependent masks: smaller tiles waste less on partial tiles (H200, document mask:
        # forward 1.10-1.21x FlexAttention with 64x64 against 0.94-0.98x with 128x128; backward
        # 0.738 -> 0.613 ms at 4x16x4096x128, 0.456 -> 0.428 ms at 16x16x1024x128 against the
        # 64x128 / 128x64 default, where sliding window and full attention measured slower)
        t = Tiles(64, 64, 4, 3)
        why += ", then 64x64 for a data-dependent mask"
    elif tuned and fwd and ((mask_class != "none" and d <= 64) or (mask_class == "banded" and d <= 128)):
        # H200, bf16, 4x32x4096x64 forward ms, 64x64 against the 128x64 default: sliding window
        # 0.40 / 0.55, ALiBi-causal 0.89 / 1.10, causal 0.68 / 0.71; 4x16x4096x128 sliding window
        # 0.37 / 0.39 against 128x128 (benchmarks/tile_sweep.py)
        t = Tiles(64, 64, 4, 3)
        why += f", then 64x64 for a {mask_class} variant at head dim {d}"
    elif tuned and fn == "attn_bwd_dkdv" and d <= 64 and not spec.dropout and mask_class != "none":
        # H200, bf16, 4x32x4096x64 backward ms against the 32x128 default (benchmarks/
        # tune_sweep.py): 32x64 document mask 0.884 -> 0.723, causal 2.149 -> 2.066, softcap
        # 2.900 -> 2.616, ALiBi 2.382 -> 2.251; a sliding window (1.185 -> 1.156) and GQA (causal
        # 2.347 -> 2.268) are fastest with 64x64 (32x64: 1.217, 2.395). Without a mask 32x64
        # measured 1.01x in one sweep and 0.96x in another: the default stays
        t = Tiles(64, 64, 4, 3) if mask_class == "banded" or spec.group > 1 else Tiles(32, 64, 4, 3)
        why += f", then {t.block_m}x{t.block_n} at head dim <= 64"
    elif tuned and fn == "attn_bwd_dkdv" and spec.dropout and d <= 64:
        # dropout regenerates its keep-mask transposed in the dK/dV kernel; square tiles make that
        # cheaper (H200, bf16, 4x32x4096x64 dropout-causal backward 4.68 -> 3.96 ms against the
        # 32x128 default; at head dim 128, 64x64 is slower: 2.76 -> 3.98 ms)
        t = Tiles(64, 64, 4, 3)
        why += ", then 64x64 for dropout at head dim <= 64"
    for _ in range(spec.shrink):
        if t.num_stages > 1:
            t = Tiles(t.block_m, t.block_n, t.num_warps, t.num_stages - 1)
        elif fn == "attn_bwd_dkdv" and t.block_m > 32:
            t = Tiles(t.block_m // 2, t.block_n, t.num_warps, t.num_stages)
        elif t.block_n > 32:
            t = Tiles(t.block_m, t.block_n // 2, t.num_warps, t.num_stages)
    if spec.shrink:
        why += f", shrunk {spec.shrink} level(s) after running out of shared memory"
    if fn == "attn_fwd_ws" and t.num_stages > WS_MAX_STAGES and spec.target != "interpreter":
        logger.warning("attn_fwd_ws tiles %s: the warp-specialised loop runs at most %d stages (3 gave wrong "
                       "results on triton 3.6); using %d", t, WS_MAX_STAGES, WS_MAX_STAGES)
        t = Tiles(t.block_m, t.block_n, t.num_warps, WS_MAX_STAGES)
    logger.debug("tiles of %s (%s, head dim %d/%d, %s): %dx%d, num_warps=%d, num_stages=%d (%s)", fn, spec.dtype,
                 spec.head_dim, spec.head_dim_v, spec.target, t.block_m, t.block_n, t.num_warps, t.num_stages, why)
    return t


def tma_pays(facts, block_sparse: bool, mask_class: str, head_dim: int) -> bool:
    """Whether the forward reads K/V through tensor descriptors under ATTNCC_TMA=auto: where it
    measured faster, for data-dependent and banded masks, and for score mods at head dims above
    64. H200, bf16, forward ms pointers -> TMA: document mask 0.370 -> 0.314 (4x32x4096x64),
    sliding window 0.371 -> 0.330 (4x16x4096x128), ALiBi-causal 0.773 -> 0.687, softcap 0.785 ->
    0.746, relative bias 1.741 -> 1.662; slower: full 1.119 -> 1.154, causal 0.645 -> 0.662,
    dropout 0.997 -> 1.058, prefix-LM 0.664 -> 0.687, and at D=64 full 1.301 -> 1.392, relative
    bias 2.400 -> 2.524 (softcap 0.98x, ALiBi 1.07x)."""
    return block_sparse or mask_class == "banded" or (not facts.score_identity and head_dim > 64)


def ws_fits(block_sparse: bool, spec: Spec) -> bool:
    """The warp-specialised kernel runs one key loop per Q tile: no dropout, no tile lists."""
    return not block_sparse and not spec.dropout


def ws_pays(facts, score, mask_class: str, spec: Spec) -> bool:
    """Whether the forward runs the persistent warp-specialised kernel (attn_fwd_ws) under
    ATTNCC_WS=auto: where it measured faster. H200, bf16, full attention, forward ms, one program
    per (Q tile, head) with the pointer loop -> persistent warp-specialised: 0.335 -> 0.257
    (16x16x1024x128), 1.134 -> 0.995 (4x16x4096x128); at 1x16x16384x128 standalone kernels in
    one process, one program per (Q tile, head) 3.97-4.11 -> persistent 3.89; cuDNN 0.23 / 0.92
    / 3.60. At head dim 64 without a mask, with the Q tiles dealt in pairs (same-machine A/B, two
    processes each): 1.305 -> 1.265 ms at 4x32x4096x64, 0.358 -> 0.349 at 16x32x1024x64; under
    a mask there it lost (causal 0.75 -> 0.81, prefix-LM 0.78 -> 0.92, softcap 0.95 -> 1.03 at
    4096; ALiBi 0.93 -> 0.91). Causal-like masks (not banded) at head dim 128 run it up to
    WS_MASKED_KV keys (ws_kv), with score mods too where the mod reads no captured tensor per
    entry (a gather in the key loop is a pointer load, see below). Triton 3.6 warp-specialises
    only loops whose loads all go through descriptors built on the device, with 4 warps per
    group (8 warps compile unspecialised), one loop per kernel: nothing else, not even one
    straight-line tile after it."""
    d = max(pow2(spec.head_dim), pow2(spec.head_dim_v))
    if not (spec.target.startswith("cuda-sm9") and spec.dtype in ("bfloat16", "float16")):
        return False
    if d == 64:
        return mask_class == "none" and facts.score_identity
    mods_fit = facts.score_identity or (mask_class == "masked" and not gathers_per_entry(score))
    return d == 128 and mask_class in ("none", "masked") and mods_fit


def ws_kv(mask_class: str, spec: Spec) -> int:
    """Keys up to which a forward with a mask launches the warp-specialised kernel (0: any). Its
    one loop runs the mask code on every tile, which long sequences do not afford. H200, bf16,
    forward ms, pointer loops (64x64 tiles to 4096 keys, see short_kv) -> warp-specialised with
    the Q tiles paired long with short, at 16x16x1024x128 / 8x16x2048x128 / 4x16x4096x128 /
    1x16x16384x128 (same-machine A/B runs, two processes each):
      causal        0.190 -> 0.180, 0.358 -> 0.310, 0.660 -> 0.585, 2.235 -> 2.171
      GQA 4:1       0.177 -> 0.174, 0.353 -> 0.311, 0.629 -> 0.569, 2.198 -> 2.156
      prefix-LM     0.306 -> 0.307, 0.436 -> 0.427, 0.695 -> 0.646, 2.277 -> 2.338
      ALiBi-causal  0.215 -> 0.198, 0.376 -> 0.342, 0.705 -> 0.652, 2.344 -> 2.399
      softcap       0.221 -> 0.214, 0.394 -> 0.364, 0.736 -> 0.694, 2.559 -> 2.572
    (cuDNN causal: 0.165, 0.288, 0.530, 1.956). Before the pairing, Q tiles dealt round-robin
    longest first left some programs up to 27% more work, and the kernel lost from 2048 keys
    (causal 0.427 at 2048, 0.71 at 4096). Under a mask the launch takes it only for stacked rows
    (see attn_fwd_ws's launch)."""
    return 0 if mask_class == "none" or spec.ws == "on" else WS_MASKED_KV


# the warp-specialised forward with 128x64 tiles and 3 stages gave wrong results on an H200
# (triton 3.6; found by the autotuner's check against the table's tiles, and NaN in a standalone
# persistent kernel): requests for more stages are capped
WS_MAX_STAGES = 2
WS_MASKED_KV = 4096  # keys up to which causal-like masks launch the warp-specialised kernel (ws_kv)
SHORT_KV = (2048, 4096)  # keys up to which causal-like masks take short forward tiles: (identity
                         # score_mod under GQA or dropout, any other), see short_kv


def short_kv(facts, score, block_sparse: bool, mask_class: str, spec: Spec) -> int:
    """Keys up to which a forward with a mask that cuts tiles (causal-like: neither banded nor
    data-dependent) launches 64x64 tiles instead of 128x128 at head dims 65..128: fewer masked
    entries computed on the tiles the diagonal crosses. H200, bf16, forward ms 128x128 -> 64x64
    (benchmarks/tune_sweep.py): at 1024 keys causal 0.250 -> 0.217, ALiBi 0.256 -> 0.211,
    softcap 0.275 -> 0.226, GQA 0.246 -> 0.214, prefix-LM 0.339 -> 0.326, dropout 0.314 -> 0.292;
    at 2048 1.02-1.14x; at 4096 ALiBi 0.694 -> 0.629 and softcap 0.758 -> 0.692, and since the
    forward compiles out its bounds checks for whole tiles (commit bd0b1f6) causal 0.622 ->
    0.588 and prefix-LM 0.663 -> 0.635 (4x16x4096x128), but GQA 0.627 -> 0.641 and dropout
    0.99x (before that commit), so those two keep them to 2048; at 8192 causal, prefix-LM and
    GQA 0.96-0.97x, at 16k causal and dropout 0.91x. A score_mod that gathers a captured tensor
    per entry (a relative-position table) was slower with them (0.586 -> 0.702 ms at 1024) and
    keeps 128x128. The interpreter takes 16x32 tiles up to 64 keys, so that CPU tests run this
    launch path. Off when tiles are chosen otherwise (autotuner, ATTNCC_TILES)."""
    if facts.mask_trivial or block_sparse or mask_class != "masked" or spec.tiles or config.tile_overrides():
        return 0
    if spec.target == "interpreter":
        return 64
    d = max(pow2(spec.head_dim), pow2(spec.head_dim_v))
    if spec.dtype == "float32" or d != 128 or gathers_per_entry(score):
        return 0
    return SHORT_KV[0] if facts.score_identity and (spec.group > 1 or spec.dropout) else SHORT_KV[1]


def gathers_per_entry(expr, both: bool = False) -> bool:
    """A captured tensor read at an index that changes with q_idx or kv_idx (``both``: with both, as a
    relative-position table's: a value per score, loaded in every step)."""
    for load in expr.atoms(sp.core.function.AppliedUndef):
        reads = {Q, KV} & set().union(*(a.free_symbols for a in load.args))
        if reads == {Q, KV} or (reads and not both):
            return True
    return False


def _base_tiles(fn: str, spec: Spec) -> Tiles:
    override = config.tile_overrides().get(fn)
    if override and spec.target != "interpreter":
        return Tiles(*override)
    if spec.target == "interpreter":
        # small tiles keep several tiles and ragged edges in tests
        return Tiles(16, 32, 1, 1) if fn in ("attn_kv_decode", "attn_fwd_short") else Tiles(32, 32, 1, 1)
    d = max(pow2(spec.head_dim), pow2(spec.head_dim_v))
    if fn in ("attn_kv", "attn_kv_decode"):  # inference; rows are (token, head) pairs of a GQA group
        if d > 256:  # MLA: a 512-wide accumulator
            return Tiles(16, 32, 4, 2) if fn == "attn_kv_decode" else Tiles(32, 32, 8, 2)
        if fn == "attn_kv_decode":
            return Tiles(16, 64 if d <= 128 else 32, 4, 3)
        return Tiles(64, 64, 4, 3) if d <= 128 else Tiles(64, 32, 4, 2)
    if spec.dtype == "float32":
        return Tiles(64, 32, 4, 2) if d <= 128 else Tiles(32, 32, 4, 1)
    # measured on an H200 with benchmarks/tile_sweep.py (bf16, causal and full, N=4096)
    if fn == "attn_fwd_short":  # short_kv: causal-like masks over few keys
        return Tiles(64, 64, 4, 3)
    if fn == "attn_fwd_ws":  # two consumer warp groups of 4 warps; 3 stages overflow shared memory
        return Tiles(128, 128, 4, 2) if d <= 128 else Tiles(64, 64, 4, 2)
    if fn == "attn_fwd":
        if d <= 64:
            return Tiles(128, 64, 8, 3)
        return Tiles(128, 128, 8, 3) if d <= 128 else Tiles(64, 32, 4, 2)
    if fn == "attn_bwd_dkdv":  # BLOCK_N keys stay resident; BLOCK_M query rows stream
        if d <= 64:
            return Tiles(32, 128, 4, 3)
        return Tiles(64, 128, 8, 3) if d <= 128 else Tiles(32, 64, 4, 2)
    if fn == "attn_bwd_dq":
        if d <= 64:
            return Tiles(64, 64, 4, 3)
        return Tiles(128, 64, 8, 3) if d <= 128 else Tiles(64, 32, 4, 2)
    return Tiles(64, 64, 4, 1)  # attn_bwd_preprocess
