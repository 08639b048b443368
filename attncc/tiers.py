"""Which template set a forward call's kernel comes from: the one place the tier is chosen.

    triton  templates/*.py.jinja: the portable tier (every GPU, the Triton interpreter) and the
            oracle the other tier is tested against
    gluon   templates/sm90/*.py.jinja: Hopper only, in Gluon (Triton's explicit-layout language):
            a producer warp streams K/V through TMA into a shared-memory ring guarded by
            mbarriers, two consumer warp groups ping-pong asynchronous wgmma against the softmax

Both tiers render one KernelPlan and print the mods with one printer (attncc.printer); only the
template set differs. ``choose`` (forward) and ``choose_backward`` return the tier and the reason,
which ``explain`` and the logs show. The inference kernels are the Triton tier's.
"""
from __future__ import annotations

from functools import lru_cache

from . import config, plan, tiles
from .spec import sm

GLUON_DTYPES = ("float16", "bfloat16")
GLUON_HEAD_DIMS = (64, 128)  # wgmma N and the TMA box: power-of-two head dims the kernel was built for
# Where the Gluon forward measured faster than the Triton tier's (H100, bf16, triton 3.6,
# benchmarks/gluon/NOTES.md): head dim -> the shortest query and key length.
#   128: 4x16x4096 full 0.884 vs 0.914 ms, causal 0.521 vs 0.579; 1x16x16384 full 3.46 vs 3.90
#   64:  only with three consumer warp groups (tiles.wide_forward: the identity score_mod, a mask
#        that does not band the keys), from 4k (H200, 2026-11-28, gluon_fwd_probe.py, P rounded in
#        pairs, Triton / Gluon ms): 4x32x4096 causal 0.764 / 0.702, GQA 4:1 0.731 / 0.692, prefix-LM
#        0.775 / 0.724; 1x32x16384 causal 2.754 / 2.260; at 16x32x1024 it loses (causal 0.232 /
#        0.341, prefix-LM 0.371 / 0.398): a program of 192 query rows has too few key tiles to
#        amortise its start
GLUON_PAYS = {128: 0, 64: 4096}
# ... and where no mask cuts the keys (every query tile runs all key tiles: twice a causal tile's
# work at one length), head dim -> the shortest length (H100, 2026-11-28, benchmarks/tier_ab.py
# twice, Triton / Gluon ms, full attention at head dim 64): 16x32x1024 0.333 / 0.346, 8x32x2048
# 0.644 / 0.594, 4x32x4096 1.265 / 1.148, 2x32x8192 2.464 / 2.156
GLUON_PAYS_UNMASKED = {64: 2048}
# ... and with a score_mod other than the identity (its code in every key step), head dim -> the
# shortest length (H200, 2026-11-28, benchmarks/tier_ab.py, Triton / Gluon ms): 16x16x1024x128 ALiBi
# 0.198 / 0.242, softcap 0.216 / 0.236 (causal 0.179 / 0.183); 8x16x2048x128 ALiBi 0.340 / 0.355,
# softcap 0.360 / 0.356; at 4096 the Gluon forward is the faster
# At head dim 64 such score_mods run on two consumer warp groups (three measured slower); there
# (H200, 2026-11-29, tier_ab.py, causal, Triton / Gluon ms) ALiBi 16x32x1024 0.253 / 0.393, 8x32x2048
# 0.454 / 0.522, 2x32x8192 1.602 / 1.718, 4x32x4096 0.827 / 0.849, 1x32x16384 3.142 / 3.105; softcap
# 0.274 / 0.385, 0.485 / 0.532, 1.831 / 1.848, 0.913 / 0.925, 3.553 / 3.382
GLUON_PAYS_SCORED = {128: 2048, 64: 16384}
# ... and where the score_mod loads a captured tensor at an index of both q_idx and kv_idx (a table
# gathered per score), head dim -> the shortest length (same runs, relative bias causal):
# 16x32x1024x64 0.775 / 0.432, 8x32x2048 1.284 / 0.571, 4x32x4096 2.307 / 0.980, 2x32x8192 4.287 /
# 2.014, 1x32x16384 8.150 / 3.686; at head dim 128 (H200, 2026-11-29, fifteenth session) 32x16x512
# 0.345 / 0.197, 16x16x1024 0.507 / 0.257, 8x16x2048 0.829 / 0.371
GLUON_PAYS_GATHERED = {128: 512, 64: 1024}
# ... and where the mask bands the keys (a sliding window: two consumer warp groups; three measured
# 1.2-1.8x slower), head dim -> the shortest length (H200, 2026-11-29, gluon_fwd_probe.py in turn,
# three rounds, sliding window 1024, Triton / Gluon ms): 16x32x1024x64 0.244 / 0.229, 4x32x4096
# 0.386 / 0.377 (tier_ab.py the same day: 0.370 / 0.375), 1x32x16384 0.421 / 0.396 (0.400 / 0.391)
GLUON_PAYS_BANDED = {64: 1024}
# ... and where it packs a GQA group's query heads into its tiles (tiles.packs_gqa), head dim -> the
# shortest length (H200, 2026-11-28, benchmarks/gluon/gluon_fwd_probe.py, GQA 4:1 causal, Triton /
# Gluon ms): 16x32x1024x64 0.225 / 0.258, 8x32x2048x64 0.386 / 0.370
GLUON_PAYS_PACKED = {64: 2048}
# ... and where the mask reads captured tensors (tile lists drive the key loops), head dim -> the
# shortest length (H200, 2026-11-28, benchmarks/tier_ab.py, causal documents, Triton / Gluon ms):
# 16x16x1024x128 0.134 / 0.194, 8x16x2048x128 0.164 / 0.204, 4x16x4096x128 0.232 / 0.250,
# 2x16x8192x128 0.395 / 0.364, 1x16x16384x128 0.597 / 0.524 (at head dim 64 two warp groups:
# 4x32x4096 0.279 / 0.404, 1x32x16384 0.704 / 0.788)
GLUON_PAYS_SPARSE = {128: 8192}

# Where the Gluon backward measured faster than the Triton tier's (bf16, triton 3.6,
# benchmarks/tier_ab.py --backward and gluon/gluon_bwd_probe.py, Triton ms / Gluon ms): head dim ->
# the shortest K/V length.
#   64:  H100 4x32x4096 1.08-1.24x (2026-11-25: full 1.24, causal 1.21, prefix-LM 1.15, ALiBi 1.14,
#        sliding window 1.08, softcap 1.18 with query tiles of 64, GQA 4:1 1.31), 1x32x16384
#        1.09-1.41x; H200 (2026-11-28) 8x32x2048 full 1.19, causal 1.14, sliding window 1.02;
#        16x32x1024 full 1.09, causal 1.03, sliding window 1.16 (since the kernels launch through
#        attncc.launcher; before, 0.73-0.99x on the H100)
#   128: H100 4x16x4096 full 1.20x, causal 1.25, sliding window 1.14, ALiBi 1.08, softcap 1.05, GQA
#        4:1 1.06-1.07; 1x16x16384 full 1.37, causal 1.29, GQA 1.21; H200 (2026-11-28) 8x16x2048
#        full 1.19, causal 1.25, sliding window 1.24, prefix-LM 1.23; 16x16x1024 full 1.14, causal
#        1.15, sliding window 1.20, prefix-LM 1.14, ALiBi 1.05, softcap 1.04; 32x16x512 full 1.05,
#        causal 1.00, ALiBi 0.95
# ATTNCC_TIER=gluon runs it wherever it fits.
GLUON_BWD_PAYS = {64: 1024, 128: 1024}
# ... and under GQA: below 4096 keys at head dim 128 (8192 at 64) a program runs all query heads of
# its K/V head and sums their dK, dV in registers (SPLIT_HEADS_FROM, sm90/bwd_launch.py.jinja); H200
# (2026-11-28, in turn, Triton / Gluon ms) GQA 4:1 causal 16x16x1024x128 0.600 / 0.526, 16x32x1024x64
# 0.684 / 0.546 (before, each query head's programs added float32 sums at 128: 0.587 / 0.622)
GLUON_BWD_PAYS_GQA = {64: 1024, 128: 1024}
# ... and where the mask reads captured tensors (tile lists drive the query loops): H200
# (2026-11-28, tier_ab.py --backward, causal documents, Triton / Gluon ms) 16x16x1024x128 0.373 /
# 0.440, 8x16x2048x128 0.468 / 0.492, 4x16x4096x128 0.654 / 0.635, 1x16x16384x128 1.631 / 1.356;
# 4x32x4096x64 0.722 / 0.784, 2x32x8192x64 1.208 / 1.201, 1x32x16384x64 1.884 / 1.667
GLUON_BWD_PAYS_SPARSE = {64: 16384, 128: 4096}


_pays: dict = {}  # (variant, head dim, group, offsets) -> gluon_pays: per call


def gluon_pays(variant, d: int, group: int = 1, offsets: bool = False) -> int:
    """The shortest query and key length from which ``auto`` runs the Gluon forward at head dim d,
    ``group`` query heads a K/V head (``offsets``: on chunks of a longer sequence)."""
    key = (variant.ir_key, d, group, offsets)
    if key not in _pays:
        _pays[key] = _shortest(variant, d, group, offsets)
    return _pays[key]


def _shortest(variant, d, group, offsets) -> int:
    facts = variant.analysis.facts
    mask_class = plan.forward_mask_class(variant.analysis)
    if facts.captures_in_mask and d in GLUON_PAYS_SPARSE:
        return GLUON_PAYS_SPARSE[d]
    if d in GLUON_PAYS_GATHERED and _gathers_by_position(variant):
        return GLUON_PAYS_GATHERED[d]
    if not facts.score_identity and d in GLUON_PAYS_SCORED:
        return GLUON_PAYS_SCORED[d]
    if facts.mask_trivial and d in GLUON_PAYS_UNMASKED:
        return GLUON_PAYS_UNMASKED[d]
    if mask_class == "banded" and d in GLUON_PAYS_BANDED and not {"b", "h"} & set(facts.mask_reads):  # as measured
        return GLUON_PAYS_BANDED[d]
    if d in GLUON_PAYS_PACKED and group > 1 and tiles.packs_gqa(facts, mask_class, d, group, offsets):
        return GLUON_PAYS_PACKED[d]
    return GLUON_PAYS.get(d, 0)


@lru_cache(maxsize=1)
def gluon_available() -> bool:
    """Triton ships Gluon with the Hopper ops the templates use (triton >= 3.6). Read from the
    installed version, not by importing triton: that import must wait until attncc knows whether
    the interpreter is wanted (attncc.runtime)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        major, minor = (int(x) for x in version("triton").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (3, 6)


# ops the printer writes as libdevice calls on GPUs (attncc.printer), which the Gluon header lacks
LIBDEVICE_OPS = ("atan", "log1p", "expm1", "round")


def _libdevice_ops(variant) -> list:
    from . import ir
    roots = [r for r in (variant.score_ir, variant.mask_ir) if r is not None]
    return sorted({n.op for r in roots for n in ir.walk(r) if n.op in LIBDEVICE_OPS})


def _row_products(variant) -> bool:
    """Whether a mod dots a query's row with a key's row (attncc.passes.rowdots): the Triton tier
    makes that one tile product, the Gluon templates would take R products per score."""
    import sympy as sp
    from .passes.rowdots import RowDot, find_row_dots
    a = variant.analysis
    caps = tuple((nd, kind, False) for nd, kind in a.captures)
    return any(find_row_dots(e, caps).has(RowDot) for e in (a.score, a.mask) if isinstance(e, sp.Basic))


def _gathers_by_position(variant) -> bool:
    """Whether the score_mod loads a captured tensor at an index that reads both q_idx and kv_idx (a
    relative-position table: a gather per score; ALiBi's slopes, read per head, and tables read per
    query or per key are not)."""
    return _indexed_by_both_positions(variant, variant.analysis.facts.captures_in_score)


def padded_views() -> bool:
    """Whether this Triton's Gluon views padded shared memory with another layout, as the backward's
    diagonal sums of relative-position tables do (sm90/attn_bwd.py.jinja, _diagonal_sums): triton
    3.6's shared_memory_descriptor._reinterpret does; 3.9's reinterpret refuses another padding."""
    try:
        from triton.experimental.gluon.language._core import shared_memory_descriptor
    except ImportError:
        return False
    return hasattr(shared_memory_descriptor, "_reinterpret")


def _index_kinds(variant, captures) -> list[str]:
    """How the score_mod indexes each load of the captured tensors numbered ``captures``: "difference"
    (both q_idx and kv_idx, through q_idx - kv_idx only: a relative-position table), "both" (both
    otherwise) or "other"."""
    from .passes import derive
    from .passes.symbolic import KV, Q
    from .plan import _reads_difference_only
    score = variant.analysis.score
    sites = [site for c in captures for site in derive.load_sites(score, c)] if score is not None else []
    return ["other" if not site.args or not {Q, KV} <= set().union(*(i.free_symbols for i in site.args))
            else "difference" if _reads_difference_only(site.args) else "both" for site in sites]


def _tables_by_difference(variant, captures) -> bool:
    """Whether the score_mod reads each of the captured tensors numbered ``captures`` only at indices
    of q_idx - kv_idx (relative-position tables)."""
    kinds = _index_kinds(variant, captures)
    return bool(kinds) and all(k == "difference" for k in kinds)


def _indexed_by_both_positions(variant, captures, but_difference: bool = False) -> bool:
    """Whether the score_mod loads one of the captured tensors numbered ``captures`` at an index
    that reads both q_idx and kv_idx (``but_difference``: other than through q_idx - kv_idx only, as
    a relative-position table does)."""
    return any(k == "both" or (k == "difference" and not but_difference) for k in _index_kinds(variant, captures))


_chosen: dict = {}  # (variant, target, dtype, head dims, dropout, ATTNCC_TIER) -> (tier, why): per call


def choose(variant, target: str, dtype: str, d: int, dv: int, dropout: bool, tensors=(), length: int | None = None,
           offsets: bool = False) -> tuple[str, str]:
    """(tier, why) of a forward call: "gluon" or "triton". ``tensors``: q, k and v, which the Gluon
    kernel reads through 4-D tensor descriptors (the output takes q's layout, so q stands for it),
    and whose lengths GLUON_PAYS may ask for; without them, ``length`` stands for both (None: not
    known, taken as short); ``offsets``: they are chunks of a longer sequence (choose_chunks). The
    part that does not depend on the tensors is memoised: per call, a few dict lookups and the
    tensors' layout check."""
    want = config.tier()
    key = (variant.ir_key, target, dtype, d, dv, dropout, want)
    chosen = _chosen.get(key)
    if chosen is None:
        chosen = _chosen[key] = _choose(variant, target, dtype, d, dv, dropout, want)
    if chosen[0] == "gluon":
        from .runtime import _addressable
        for t in tensors:  # a loop, not any(<generator>): host time per call
            if not _addressable(t) or t.shape[2] == 0:
                return "triton", ("a tensor TMA cannot address (unit head-dim stride, 16-byte aligned strides, "
                                  "no empty length)")
        group = tensors[0].shape[1] // tensors[1].shape[1] if tensors else 1
        shortest = gluon_pays(variant, d, group, offsets) if want == "auto" else 0
        if tensors:
            length = min(tensors[0].shape[2], tensors[1].shape[2])
        if shortest and (length is None or length < shortest):
            return "triton", (f"head dim {d}, {'an unknown length' if length is None else f'{length} queries or keys'} "
                              f"(< {shortest}): the Gluon forward measured slower (tiers.gluon_pays)")
    return chosen


def _choose(variant, target, dtype, d, dv, dropout, want) -> tuple[str, str]:
    if want == "triton":
        return "triton", "ATTNCC_TIER=triton"
    if sm(target) != 90:
        return "triton", f"the Gluon tier is built for sm90 (Hopper); this target is {target}"
    why_not = _unfit(variant, dtype, d, dv, dropout)
    if why_not:
        return "triton", why_not
    if want == "auto" and d not in GLUON_PAYS:
        return "triton", f"head dim {d}: the Gluon forward measured slower than the Triton tier's (tiers.GLUON_PAYS)"
    facts = variant.analysis.facts
    wide = d == 64 and tiles.wide_forward(facts, plan.forward_mask_class(variant.analysis), d)
    if want == "auto" and d == 64 and not wide and facts.captures_in_mask:
        return "triton", ("head dim 64, a mask that reads tensors: the Gluon forward spills with three consumer "
                          "warp groups (tiles.wide_forward) and measured slower with two")
    return "gluon", "ATTNCC_TIER=gluon" if want == "gluon" else f"sm90, {dtype}, head dim {d}: measured faster" + (
        f" ({'three' if wide else 'two'} consumer warp groups)" if d == 64 else "")


def _unfit(variant, dtype, d, dv, dropout) -> str | None:
    if not gluon_available():
        return "this Triton has no Gluon Hopper ops the templates use (needs triton >= 3.6)"
    if dtype not in GLUON_DTYPES:
        return f"{dtype}: the Gluon tier runs float16 and bfloat16"
    if d != dv or d not in GLUON_HEAD_DIMS:
        return f"head dims {d} / {dv}: the Gluon tier takes equal head dims of {' or '.join(map(str, GLUON_HEAD_DIMS))}"
    if dropout:
        return "dropout: the Gluon tier has no dropout yet"
    ops = _libdevice_ops(variant)
    if ops:
        return f"the mods use {', '.join(ops)}, which the Triton tier computes with libdevice"
    if _row_products(variant):
        return "a mod dots a query's row with a key's row, which the Triton tier computes as one tile product"
    return None


def choose_chunks(variant, target: str, dtype: str, d: int, dv: int, dropout: bool, chunks) -> tuple[str, str]:
    """(tier, why) of context parallelism's forward kernels, which run on chunks of q, k and v at
    their positions in the whole sequence (the Gluon templates take them as Q_OFF and KV_OFF where
    plan.offsets says): ``chunks`` holds each one's first chunk (the others start whole rows after
    it, so TMA addresses them where it does these)."""
    return choose(variant, target, dtype, d, dv, dropout, chunks, offsets=True)


def choose_backward(variant, fwd_spec, learnable: tuple, deterministic: bool, kv_len: int | None = None
                    ) -> tuple[str, str]:
    """(tier, why) of the backward of a call whose forward ran under ``fwd_spec`` with ``kv_len``
    keys (None: a length not known, taken as short): the Gluon kernel (one program per K/V tile,
    dQ added by float32 TMA reduce-adds) where it fits and measured faster, else the Triton tier's
    kernels."""
    want = config.tier()
    if want == "triton":
        return "triton", "ATTNCC_TIER=triton"
    if sm(fwd_spec.target) != 90:
        return "triton", f"the Gluon tier is built for sm90 (Hopper); this target is {fwd_spec.target}"
    d = fwd_spec.head_dim
    why_not = _unfit(variant, fwd_spec.dtype, d, fwd_spec.head_dim_v, fwd_spec.dropout)
    if why_not is None and learnable and _indexed_by_both_positions(variant, learnable, but_difference=True):
        why_not = ("a learnable captured tensor indexed by both q_idx and kv_idx other than through q_idx - kv_idx: "
                   "the Gluon backward has no per-score gradient")
    if why_not is None and learnable and _indexed_by_both_positions(variant, learnable) and not padded_views():
        why_not = ("a learnable relative-position table: the Gluon backward sums its diagonals through a padded view "
                   "of shared memory, which this Triton's Gluon refuses (triton 3.6's has it)")
    if why_not is None and learnable and want != "gluon" and not _tables_by_difference(variant, learnable):
        # per step, a sum over the tile and an atomic per site: learned ALiBi slopes measured 0.46x
        # (4x32x4096x64) and 0.89-0.91x (head dim 128, 4k and 16k) the Triton tier's backward. Relative-
        # position tables (the tile's diagonals summed through shared memory, an atomic per diagonal)
        # measured 1.4-1.9x faster than it (H200, causal, 1024 to 16384 keys, head dims 64 and 128)
        why_not = ("learnable captured tensors: the Gluon backward's per-step sums and atomics for their "
                   "gradients measured slower than the Triton tier's (ATTNCC_TIER=gluon takes them)")
    if why_not is None and deterministic:
        why_not = "deterministic: the Gluon backward adds dQ in any order (TMA reduce-add), the Triton tier's does not"
    if why_not:
        return "triton", why_not
    if want == "gluon":
        return "gluon", "ATTNCC_TIER=gluon"
    why_not = _bwd_slower(d, fwd_spec.group, kv_len, bool(variant.analysis.facts.captures_in_mask))
    if why_not:
        return "triton", f"{why_not}: the Gluon backward measured slower than the Triton tier's (tiers.gluon_bwd_pays)"
    return "gluon", f"sm90, {fwd_spec.dtype}, head dim {d}, {kv_len} keys: measured faster"


def gluon_bwd_pays(d: int, group: int = 1, sparse: bool = False) -> int | None:
    """The shortest K/V length from which ``auto`` runs the Gluon backward at head dim d with
    ``group`` query heads per K/V head (``sparse``: a mask that reads captured tensors; None: at
    no length)."""
    shortest = (GLUON_BWD_PAYS_GQA if group > 1 else GLUON_BWD_PAYS).get(d)
    if sparse and shortest is not None:
        return max(shortest, GLUON_BWD_PAYS_SPARSE.get(d, 0))
    return shortest


def long_enough(d: int, group: int, kv_len: int | None, sparse: bool = False) -> bool:
    """Whether kv_len keys reach the length from which the Gluon backward pays (what of the
    length the backward's tier depends on)."""
    shortest = gluon_bwd_pays(d, group, sparse)
    return kv_len is not None and shortest is not None and kv_len >= shortest


def _bwd_slower(d: int, group: int, kv_len: int | None, sparse: bool = False) -> str | None:
    min_len = gluon_bwd_pays(d, group, sparse)
    if min_len is None:
        return f"head dim {d}"
    if kv_len is None or kv_len < min_len:
        return (f"head dim {d}{', GQA' if group > 1 else ''}{', a mask reading tensors' if sparse else ''}, "
                f"{'an unknown number of' if kv_len is None else kv_len} keys (< {min_len})")
    return None
