"""KernelPlan: the one frozen object a template sees, built from a variant's analysis and a Spec."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import sympy as sp

from . import __version__, printer
from .passes import bounds as bounds_pass
from .passes import derive as derive_pass
from .passes.symbolic import H, KV, Q, SCORE
from .spec import Spec, sm  # Spec is re-exported: plan.Spec
from . import tiles
from .tiles import pow2, choose_tiles, gluon_tiles, gathers_per_entry, short_kv, split_dim, tma_pays, ws_fits, ws_kv, ws_pays
from .variant import Analysis

# the outer tile's first and last index, as the kernels name them
Q_LO, Q_HI, KV_LO, KV_HI = sp.symbols("q_lo q_hi kv_lo kv_hi", integer=True)


@dataclass(frozen=True)
class CaptureArg:
    """Kernel arguments of one captured tensor: pointer, then (size, stride) per dimension."""
    index: int
    ndim: int
    kind: str
    describe: str

    @property
    def name(self):
        return f"cap{self.index}"

    @property
    def args(self):
        dims = [f"cap{self.index}_size{d}, cap{self.index}_stride{d}" for d in range(self.ndim)]
        return [f"cap{self.index}_ptr"] + dims

    @property
    def host_args(self):
        c = self.name
        return [c] + [f"{c}.shape[{d}], {c}.stride({d})" for d in range(self.ndim)]

    @property
    def size_args(self):
        return [f"cap{self.index}_size{d}" for d in range(self.ndim)]


@dataclass(frozen=True)
class CapGrad:
    """Accumulation of one load site's gradient into a learnable captured tensor.

    ``reduce`` says which tile axes the index does not depend on, so they are summed in
    registers before the atomic add: "both" (e.g. slopes[h]), "kv" (index reads q_idx only),
    "q" (index reads kv_idx only), "diag" (index reads q_idx - kv_idx only: one atomic per
    diagonal of the tile) or "none" (one atomic per score)."""
    capture: int
    label: str       # the mods output holding d score_mod / d load
    offset: str      # Triton text of the element offset into the gradient buffer
    mask: str        # Triton text: the index is in range (and its row / column exists)
    reduce: str
    # "diag": the index reads q_idx - kv_idx only (a relative-position table), so each diagonal
    # of the tile is summed first; offset and mask of the diagonal through (q_diag, kv_first)
    diag_offset: str | None = None
    diag_mask: str | None = None


@dataclass(frozen=True)
class TileRange:
    """Triton text of the mask-derived inner-index bounds of one outer tile (None: unbounded)."""
    reach_first: str | None
    reach_end: str | None     # one past the last index some row attends
    full_first: str | None
    full_end: str | None
    full_empty: bool          # no tile is known to be fully unmasked
    reach_text: str           # the intervals as math, for a comment
    full_text: str

    @property
    def unbounded(self) -> bool:
        """The mask bounds nothing (no mask, or a score_mod alone): every tile is whole, and only
        a ragged one at the end of a length needs the masked loops."""
        return not self.full_empty and self.reach_first is None and self.reach_end is None \
            and self.full_first is None and self.full_end is None

    @property
    def starts_whole(self) -> bool:
        """Whole tiles start at the first inner index: no masked tile comes before them, so the
        kernels generate no loop for one (a loop that can only be empty still costs registers)."""
        return not self.full_empty and self.reach_first is None and self.full_first is None

    @property
    def ends_whole(self) -> bool:
        """Whole tiles reach the end of the inner length: after them comes at most a ragged tile."""
        return not self.full_empty and self.reach_end is None and self.full_end is None


def _tile_range(mask, outer, inner, lo, hi, printer_) -> TileRange:
    tb = bounds_pass.derive(mask, outer, inner, lo, hi)
    big = {sp.oo: sp.Integer(2**30), -sp.oo: sp.Integer(-2**30)}  # +-oo inside expressions, as int32
    text = lambda e: None if e in (sp.oo, -sp.oo) else printer_.doprint(e.xreplace(big))
    end = lambda e: None if e == sp.oo else printer_.doprint((e + 1).xreplace(big))
    empty = tb.full.first == sp.oo or tb.full.last == -sp.oo
    return TileRange(text(tb.reach.first), end(tb.reach.last), None if empty else text(tb.full.first),
                     None if empty else end(tb.full.last), empty,
                     f"{tb.reach.first}, {tb.reach.last}", f"{tb.full.first}, {tb.full.last}")


@dataclass(frozen=True)
class RowKeep:
    """mask_mod as an interval of the inner index for each outer index (bounds_pass.row_interval),
    in Triton text over the outer index: its first index and one past its last (None: unbounded)."""
    first: str | None
    end: str | None
    text: str  # the interval as math, for a comment


def _row_keep(mask, outer, inner, printer_) -> RowKeep | None:
    iv = bounds_pass.row_interval(mask, outer, inner)
    if iv is None:
        return None
    big = {sp.oo: sp.Integer(2**30), -sp.oo: sp.Integer(-2**30)}  # +-oo inside expressions, as int32
    return RowKeep(None if iv.first == -sp.oo else printer_.doprint(iv.first.xreplace(big)),
                   None if iv.last == sp.oo else printer_.doprint((iv.last + 1).xreplace(big)),
                   f"{iv.first}, {iv.last}")


def _band(mask) -> int:
    """How many keys each query keeps where mask_mod keeps one interval of them whose width is a
    constant (a sliding window: 1024 for ``q - k < 1024`` with causal), else 0."""
    iv = bounds_pass.row_interval(mask, Q, KV)
    if iv is None or iv.first.is_infinite or iv.last.is_infinite:
        return 0
    width = sp.simplify(iv.last + 1 - iv.first)
    return int(width) if width.is_Integer and width > 0 else 0


def _keep_by_rows(outputs: list, loop: set) -> list:
    """outputs with mask_mod ("keep") written as each row's interval of the loop's index where it is
    exactly one with plain ends (bounds_pass.row_interval): the ends are computed once a row and each
    score costs two compares (sliding window, keys per query: ``(kv_idx <= q_idx) & (kv_idx >= q_idx -
    1023)`` for ``(q_idx >= kv_idx) & (kv_idx - q_idx > -1024)``, a subtraction a score fewer)."""
    (inner,) = loop
    outer = Q if inner == KV else KV
    out = []
    for label, e in outputs:
        iv = bounds_pass.row_interval(e, outer, inner) if label == "keep" else None
        if iv is not None and not any(x.has(sp.Piecewise) or (x.has(sp.oo, -sp.oo) and not x.is_infinite)
                                      for x in (iv.first, iv.last)):
            sides = ([inner >= iv.first] if iv.first != -sp.oo else []) + ([inner <= iv.last] if iv.last != sp.oo else [])
            e = sp.And(*sides) if sides else e
        out.append((label, e))
    return out


@dataclass(frozen=True)
class KernelPlan:
    kernel: str           # "fwd" or "bwd": which template
    attncc_version: str
    target: str
    dtype: str
    head_dim: int
    head_dim_v: int
    block_d: int
    block_dv: int
    group: int
    dot_precision: str
    score_text: str
    mask_text: str
    score_identity: bool  # score_mod is the identity: the scale folds into exp2
    # score_mod is the identity and the scale positive, so the row max of q.k * scale is
    # max(q.k) * scale and each probability costs one FMA, exp2(q.k * scale - m), as in FA3.
    # Where it measured faster or the same (H200, bf16, forward, two A/B runs): the forward at
    # head dim <= 64 (causal 0.751 -> 0.718 ms, prefix-LM 0.79 -> 0.76, dropout 1.15 -> 1.13 at
    # 4x32x4096x64) and with TMA (sliding window 0.33 -> 0.32, 0.386 -> 0.370 at 16k), and the
    # memory-bound inference kernels; the forward with pointer loads at head dim 128 measured
    # 1-3% slower with it (full 1.08 -> 1.11 ms, causal 0.63 -> 0.65 at 4x16x4096x128)
    fold_scale: bool
    dscore_one: bool      # d score_mod / d score == 1 (identity or additive bias)
    score_broadcast: bool  # score_mod's value is not a float tile by itself (constant, int, no score)
    captures: tuple       # CaptureArg per captured tensor
    tiles: dict           # kernel function name -> Tiles
    mods: dict            # kernel function name -> printer.ModCode
    bounds: dict          # kernel function name -> TileRange of its inner loop
    grads: tuple = ()     # CapGrad per learnable load site (bwd)
    row_dots: bool = False  # the mods call _row_dot (attncc.passes.rowdots): the header defines it
    # score_mod = score + bias: the mods compute bias * log2(e) ("bias") and the kernels take
    # s = q.k * (scale * log2(e)) + bias, one FMA per score for the scale, the bias and the change
    # to log2 units (backward and decode kernels, see build)
    log2_bias: bool = False
    # ... and that bias is a per-query part plus a per-key part (ALiBi): the Gluon backward computes
    # them ("bias_q", "bias_kv") before S^T is issued and starts S^T's accumulator from them (split_bias)
    split_bias: bool = False
    block_sparse: bool = False    # the mask reads captured tensors: precomputed tile lists drive the loops
    class_per_head: bool = False  # ... and reads b or h, so each (b, h) has its own tile classes
    atomic_dq: bool = False  # bwd: dq by atomic adds from the dK/dV kernel instead of its own kernel
    dropout: bool = False     # the Philox dropout mask is compiled in
    deterministic: bool = False  # capture gradients accumulate as int64 fixed point (bitwise reproducible)
    split_d: tuple = (16, 0)  # kv: the head dim in two power-of-two pieces (split_dim)
    tma: bool = False         # fwd: K and V are tensor descriptors (TMA loads, zero-filled past the ends)
    # fwd: when the keys fill whole tiles, a persistent kernel (attn_fwd_ws, one program per SM)
    # whose key loop Triton warp-specialises on Hopper (a producer warp streams K/V through
    # descriptors built on the device, two consumer warp groups of 64 rows compute), with its own
    # tiles, warps and stages (tiles["attn_fwd_ws"]); under a mask its one loop runs the mask code
    # on every tile, up to ws_kv keys (0: any). Which variants take it: tiles.ws_fits / ws_pays
    ws: bool = False
    ws_kv: int = 0
    # bwd, GQA: the dK/dV kernel runs the (query tile, query head) pairs of its group in one loop
    # per class of tile, not the tile loops inside a loop over heads, which spilled ~300 registers
    # at head dim 128 (H200, triton 3.6). Needs tile bounds that do not depend on h; data-dependent
    # masks keep the loop over heads (it spilled less there).
    flat_group: bool = False
    # Gluon forward, GQA: the query heads of a K/V head packed into a tile's rows (FA4's pack_gqa),
    # PACK of them (1: one query head a tile). Row r of a warp group's BLOCK_M is query position
    # r // PACK of head r % PACK, so one K/V tile serves PACK heads and a tile spans BLOCK_M / PACK
    # positions (less of a causal tile past the diagonal). Where: tiles.packs_gqa
    pack_gqa: int = 1
    # fwd: keys up to which the launch takes the smaller tiles["attn_fwd_short"] (0: never), see
    # short_kv below
    short_kv: int = 0
    # kv on Hopper and later: merge_splits is a programmatic dependent launch of attn_kv
    pdl: bool = False
    # the template set (attncc.tiers): "triton" (templates/) or "gluon" (templates/sm90/: the
    # forward and the backward, their mods printed in Gluon's language)
    tier: str = "triton"
    # Gluon tier: mask_mod as each outer index's interval of the inner one (None: not one), which the
    # masked steps test with two compares a score (attn_fwd: keys per query; attn_bwd: queries per key)
    row_keep: RowKeep | None = None
    # Gluon tier: the kernels take Q_OFF and KV_OFF, the positions of the call's first query and key
    # (a chunk of a longer sequence, attncc.distributed): mods and tile bounds see positions, loads
    # and stores the chunk's rows. The Triton tier takes them always (and ignores this)
    offsets: bool = False
    # Gluon forward: P rounded to bfloat16 or float16 two columns at a time (one cvt.rn.bf16x2.f32 or
    # f16x2 per register of the P V product's A operand) in every kernel: ptxas rounds them one by
    # one, pairs the halves the other way round and swaps them back (64 PRMT a key step: 491 -> 427
    # instructions at head dim 64). H200, in turn (benchmarks/gluon/gluon_fwd_probe.py, 2026-11-28),
    # bf16 ms: head dim 64 causal 4x32x4096 0.754 -> 0.702, 1x32x16384 2.428 -> 2.260, GQA 4:1
    # 0.734 -> 0.692, prefix-LM 0.771 -> 0.724 (H100, 2026-11-25: full 1x32x16384 4.513 -> 4.132);
    # at head dim 128 with the row max as a tree (below; without it, full 1x16x16384 3.432 -> 3.556)
    probs_in_pairs: bool = False
    # Gluon forward, three consumer warp groups (head dim 64), masks kept as row intervals
    # (row_keep): masked steps compare each score's column relative to the thread's first key
    # (templates/sm90/attn_fwd.py.jinja), one immediate compare and one FSEL a score; False: compared
    # as kv_idx (two FSEL a score). SASS, masked step: causal 725 -> 565 instructions at head dim 64
    # (792 -> 627 at 128), no stack. H200, in turn (gluon_fwd_probe.py, 2026-11-28), ms lane / kv
    # compares: head dim 64 causal 4x32x4096 0.700 / 0.708, prefix-LM 0.712 / 0.735; at head dim 128
    # equal at 4k and 0.8-1.3 % slower at 16k (causal 1.798 / 1.783, prefix-LM 1.839 / 1.815, five
    # rounds), so two warp groups keep kv compares, except for bands (sliding window, whose masked
    # steps are most of its steps): 16x16x1024 0.166 / 0.166, 4x16x4096 0.268 / 0.273 (in turn,
    # 2026-11-29; 0.271 -> 0.268 and 16k 0.285 -> 0.281 a day earlier). The backward's step in this
    # form spilled (head dim 64 causal: 168 bytes of stack, 892 instructions against 883)
    lane_compares: bool = False
    # Gluon forward, two consumer warp groups: each thread's part of the row max as a tree over the
    # key columns it holds (Triton reduces them as one chain of 31 dependent FMNMX at head dim 128,
    # on the softmax's path while the other warp group's products run). H100, five rounds in turn,
    # ms chain / tree with the pairs: head dim 128 full 4x16x4096 0.936 / 0.891, causal 0.537 /
    # 0.524, GQA 4:1 causal 0.532 / 0.517, full 1x16x16384 3.600 / 3.501, causal 1.868 / 1.779.
    # Three warp groups (head dim 64) keep the chain (causal 1x32x16384 2.423 / 2.537 with the tree);
    # a tree for the row sum lost everywhere (it waits for pairs of exp2, the chain takes them in turn)
    row_max_tree: bool = False
    # Gluon backward at head dims above 64: d score_mod / d score is computed after dP^T's wait from
    # score_mod's value, which P^T gives back (log2(P^T) + lse2 = score_mod * log2(e)), instead of
    # beside the score and kept through the softmax and the wait (derive.dscore_of_value; the mods'
    # ``late`` statements, which read score_mod_log2). Softcap's 32 registers of dscore made ptxas spill
    # 23 registers a step and reload 35 at head dim 128 (none stored, 7 reloaded with this). H200,
    # softcap 30 causal, in turn (benchmarks/gluon/gluon_bwd_probe.py, 2026-11-28, patch
    # dscore-from-p), ms kept / recomputed: 16x16x1024x128 0.681 / 0.614, 4x16x4096x128 1.921 /
    # 1.699, 1x16x16384x128 6.994 / 5.995; at head dim 64, which did not spill, 4x32x4096x64 2.057 /
    # 2.286, so it keeps dscore there
    dscore_late: bool = False
    # Gluon forward: the keys each query keeps where that is a constant-width window (_band), else 0.
    # Where the band is narrow beside the keys, every Q tile has about the same work, and the launcher
    # runs one program per SM over the tiles as for unmasked attention (H100, bf16, ms one program a
    # tile / per SM: sliding window 1024 at 4x16x4096x128 0.276 / 0.263, 1x16x16384x128 0.297 / 0.278,
    # 4x32x4096x64 0.410 / 0.378); causal keeps a program per tile (the static split's programs get
    # tiles of unequal lengths: 1x16x16384x128 1.80 / 2.57)
    band: int = 0

    @property
    def runtime_ints(self):
        """Integer arguments Triton must not specialise on, so new lengths never recompile."""
        extra = ["CLS_OUTER", "CLS_INNER"] if self.block_sparse else []
        return ["N_CTX_Q", "N_CTX_KV"] + extra + self.capture_sizes

    @property
    def capture_sizes(self):
        return [s for c in self.captures for s in c.size_args]

    @property
    def learnable(self):
        return sorted({g.capture for g in self.grads})


LOG2E = sp.Float(1.4426950408889634)  # exp(x) = exp2(x * log2(e))


SAFE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def comment_name(cap) -> str | None:
    """A captured tensor's Python name where generated files show it (comments and the module
    docstring only: code names it cap<i>): a plain identifier of at most 40 characters, else
    None. A name set through attncc.ir can be any text; only this form is inert there."""
    name = getattr(cap, "name", None)
    return name if isinstance(name, str) and SAFE_NAME.fullmatch(name) else None


def _describe(i, ndim, kind, cap, facts, in_range) -> str:
    users = [n for n, caps in (("score_mod", facts.captures_in_score), ("mask_mod", facts.captures_in_mask))
             if i in caps]
    name = comment_name(cap)
    label = f"`{name}` " if name else ""
    inside = ", every index inside it at the call's lengths (no bounds masks)" if in_range else ""
    return f"{label}{kind} tensor, {ndim}-d, read by {' and '.join(users) or 'nothing'}{inside}"


def _offset_and_bounds(index, capture, printer_, at_positions=True):
    """Offset and bounds checks of a gradient's atomic add; none where the index is at the tile's
    positions and stays inside the tensor there (``printer.in_range``). The diagonal sums add at
    points (q_diag, kv_first) off the tile, which keep their checks."""
    offset, bounds = printer_.address(capture, index, f"dcap{capture}_stride")
    checked = bounds and not (at_positions and printer_.in_range(capture))
    return offset or "0", [bounds] if checked else []  # "0": a constant index, as printer._load has it


def _reads_difference_only(index) -> bool:
    """Every index expression is unchanged by (q_idx, kv_idx) -> (q_idx + t, kv_idx + t)."""
    t = sp.Symbol("t", integer=True)
    return all(sp.simplify(i.subs({Q: Q + t, KV: KV + t}, simultaneous=True) - i) == 0 for i in index)


def _cap_grad(g, j, printer_) -> CapGrad:
    index = g.load.args
    offset, bounds = _offset_and_bounds(index, g.capture, printer_)
    syms = set().union(*[i.free_symbols for i in index]) if index else set()
    reduce = {(False, False): "both", (True, False): "kv", (False, True): "q", (True, True): "none"}[
        (Q in syms, KV in syms)]
    diag_offset = diag_mask = None
    if reduce == "none" and _reads_difference_only(index):
        reduce = "diag"
        at = {Q: sp.Symbol("q_diag", integer=True), KV: sp.Symbol("kv_first", integer=True)}
        diag_offset, diag_bounds = _offset_and_bounds([i.xreplace(at) for i in index], g.capture, printer_, False)
        diag_mask = printer_.as_bool(" & ".join(diag_bounds))
    # rows / columns that exist: what the sum did not already fold away
    valid = {"both": [], "kv": ["row_ok"], "q": ["col_ok"], "none": ["valid"], "diag": ["valid"]}[reduce]
    mask = printer_.as_bool(" & ".join(valid + bounds)) if valid + bounds else "None"
    return CapGrad(g.capture, f"dcap{j}", offset, mask, reduce, diag_offset, diag_mask)


def _mask_class(facts, fwd_bounds) -> str:
    """'none' (no mask), 'banded' (the keys a query tile reaches start past 0 for some tiles, like a
    sliding window's) or 'masked', from the queries-outer tile bounds (None: not derived)."""
    return ("none" if facts.mask_trivial else
            "banded" if fwd_bounds is not None and fwd_bounds.reach_first is not None else "masked")


def forward_mask_class(analysis: Analysis) -> str:
    """build's mask_class of a forward, for attncc.tiers."""
    if analysis.facts.mask_trivial:
        return "none"
    return _mask_class(analysis.facts, _tile_range(analysis.mask, Q, KV, Q_LO, Q_HI, printer.TritonPrinter((), False)))


# The Gluon backward starts S^T's accumulator from a separable bias as it does from lse (split_bias).
# ALiBi causal, H200, backward ms bias in the step / split, timed in both orders: 4x16x4096x128
# 1.506-1.510 / 1.461-1.463, 1x16x16384x128 5.21-5.25 / 5.06-5.09, 4x32x4096x64 1.89 / 1.70,
# 1x32x16384x64 6.32-6.33 / 5.83 (gluon_bwd_probe.py's `no-split-bias` turns it off)
SPLIT_BIAS = True


def build(kernel: str, analysis: Analysis, spec: Spec, captures=()) -> KernelPlan:
    """The plan for the forward ('fwd') or backward ('bwd') kernels of a variant under a Spec."""
    f = analysis.facts
    score = None if f.score_identity else analysis.score
    keep = None if f.mask_trivial else analysis.mask
    cap_info = tuple((nd, kind, i in spec.in_range) for i, (nd, kind) in enumerate(analysis.captures))
    # The backward and decode kernels take an additive bias in log2 units over float positions
    # (s = q.k * scale * log2(e) + bias). Same-run A/B on an H200 (bf16, ALiBi-causal, against
    # the score_mod form with integer positions): backward 2.02 -> 1.97 ms at 4x16x4096x128
    # (1.967 -> 1.953 in a second A/B) and 0.709 -> 0.697 at 16x16x1024x128, unchanged at head
    # dim 64; the forward 0.62 -> 0.65 and 0.218 -> 0.221, so the forward keeps the score_mod
    # form. A bias that gathers a captured tensor per score (a relative-position table) keeps it
    # everywhere: one cross-run reading had its backward slower with the log2 form, never
    # rechecked side by side.
    log2_bias = kernel != "fwd" and score is not None and f.score_bias and not gathers_per_entry(score)
    gluon = kernel in ("fwd", "bwd") and spec.tier == "gluon"
    parts = derive_pass.split_bias(LOG2E * (score - SCORE)) if log2_bias and gluon and SPLIT_BIAS and not spec.learnable else None
    outputs = []
    if parts is not None:
        outputs += [("bias_q", parts[0]), ("bias_kv", parts[1])]
    elif score is not None:
        outputs.append(("bias", LOG2E * (score - SCORE)) if log2_bias else ("score_mod", score))
    if kernel != "fwd":
        outputs = [(label, printer.float_positions(e)) for label, e in outputs]
    if keep is not None:
        outputs.append(("keep", keep))
    grads = ()
    dscore_one = f.score_bias  # d score_mod / d score == 1: the backward reads no dscore
    of_value = None  # dscore over score_mod's value (bwd: dscore_late)
    interp = spec.target == "interpreter"
    lang = "gl" if gluon else "tl"
    if kernel == "fwd":
        fns = {"attn_fwd": {KV}}
    elif kernel == "kv":
        fns = {"attn_kv": {KV}}
    else:
        derived = derive_pass.derive(analysis.score, spec.learnable)
        dscore_one = f.score_identity or derived.dscore == 1  # score + floor(score): 1, not a bias
        of_value = (derive_pass.dscore_of_value(analysis.score, derived.dscore)
                    if gluon and not dscore_one and spec.head_dim > 64 else None)
        if not dscore_one:
            outputs.append(("dscore", printer.float_positions(derived.dscore if of_value is None else of_value)))
        outputs += [(f"dcap{j}", printer.float_positions(g.derivative)) for j, g in enumerate(derived.loads)]
        grads = tuple(_cap_grad(g, j, printer.TritonPrinter(cap_info, interp, lang)) for j, g in enumerate(derived.loads))
        # the Gluon tier's one kernel holds a K/V tile and streams the query tiles (dQ by TMA reduce-add)
        fns = {"attn_bwd_dkdv": {Q}} if gluon else {"attn_bwd_dkdv": {Q}, "attn_bwd_dq": {KV}, "attn_bwd_preprocess": set()}
    tile_rows = not gluon and (interp or sm(spec.target) >= 80)  # row products as tl.dot: bf16 and tf32 want sm80+
    late = (derive_pass.SCORE_MOD_LOG2,) if of_value is not None else ()
    mods = {fn: printer.emit(_keep_by_rows(outputs, loop), cap_info, loop, interp, lang, tile_rows, late)
            for fn, loop in fns.items() if loop}
    row_dots = any("_row_dot(" in text for m in mods.values() for _, text in m.hoisted + m.body)
    tp = printer.TritonPrinter(cap_info, interp, lang)
    mask = analysis.mask
    ranges = {"attn_fwd": (Q, KV, Q_LO, Q_HI), "attn_bwd_dq": (Q, KV, Q_LO, Q_HI),
              "attn_bwd_dkdv": (KV, Q, KV_LO, KV_HI), "attn_kv": (Q, KV, Q_LO, Q_HI)}
    tile_bounds = {fn: _tile_range(mask, *ranges[fn], tp) for fn in fns if fn in ranges}
    if "attn_kv" in fns and H in mask.free_symbols:
        # the inference kernel's rows span the heads of a GQA group: bounds that depend on h
        # would differ per row, so it visits every tile with the mask instead
        tile_bounds["attn_kv"] = _tile_range(sp.true, Q, KV, Q_LO, Q_HI, tp)
        tile_bounds["attn_kv"] = dataclasses.replace(tile_bounds["attn_kv"], full_empty=True,
                                                     full_first=None, full_end=None, full_text="(none)")
    block_sparse = bool(f.captures_in_mask)
    whole_tiles = "attn_bwd_dkdv" not in tile_bounds or not tile_bounds["attn_bwd_dkdv"].full_empty
    fwd_bounds = tile_bounds.get("attn_fwd") or tile_bounds.get("attn_bwd_dq")  # queries outer, keys inner
    mask_class = _mask_class(f, fwd_bounds)
    three = kernel == "fwd" and gluon and tiles.wide_forward(f, mask_class, spec.head_dim)
    gathers = score is not None and gathers_per_entry(score, both=True)  # a table read per score (tiles.gluon_tiles)
    row_max_tree = kernel == "fwd" and gluon and not three
    probs_in_pairs = spec.dtype in ("bfloat16", "float16") and (row_max_tree or three)
    packs = kernel == "fwd" and gluon and not block_sparse and tiles.packs_gqa(f, mask_class, spec.head_dim, spec.group,
                                                                         spec.offsets)
    if block_sparse and kernel == "fwd" and not gluon:  # the Triton tier's forward module classifies for both tiers
        mods["block_classes"] = printer.emit([("keep", mask)], cap_info, set(), interp)
    caps = tuple(CaptureArg(i, nd, kind, _describe(i, nd, kind, captures[i] if i < len(captures) else None, f,
                                                   i in spec.in_range))
                 for i, (nd, kind) in enumerate(analysis.captures))
    d = max(pow2(spec.head_dim), pow2(spec.head_dim_v))
    ws = kernel == "fwd" and not gluon and not row_dots and ws_fits(block_sparse, spec) and (
        spec.ws == "on" or (spec.ws == "auto" and ws_pays(f, analysis.score, mask_class, spec)))
    ws_limit = ws_kv(mask_class, spec) if ws else 0
    general = kernel == "fwd" and not gluon and (not ws or ws_limit > 0)  # attn_fwd runs some of the lengths
    tma = general and (spec.tma == "on" or (spec.tma == "auto" and tma_pays(f, block_sparse, mask_class, d)))
    short = short_kv(f, analysis.score, block_sparse, mask_class, spec) if general else 0
    if ws:
        fns = {**fns, "attn_fwd_ws": set()}
    if short:
        fns = {**fns, "attn_fwd_short": set()}
    # the Gluon backward sums a relative-position table's gradient per 64 x 64 tile (sm90/bwd_diagonals.py.jinja);
    # such a table is read per score, so its query tiles are 64 (tiles.gluon_tiles)
    assert not (gluon and any(g.reduce == "diag" for g in grads)) or gathers, "diagonal sums need query tiles of 64"
    return KernelPlan(
        kernel=kernel, attncc_version=__version__, target=spec.target, dtype=spec.dtype,
        head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
        block_d=pow2(spec.head_dim), block_dv=pow2(spec.head_dim_v), group=spec.group,
        dot_precision="ieee" if spec.dtype == "float32" else "tf32",
        score_text=str(analysis.score), mask_text=str(analysis.mask),
        score_identity=f.score_identity, dscore_one=dscore_one, captures=caps,
        fold_scale=f.score_identity and spec.positive_scale and (gluon or kernel == "kv" or (kernel == "fwd" and (tma or (ws and not ws_limit) or d <= 64))),
        score_broadcast=SCORE not in analysis.score.free_symbols or bool(analysis.score.is_integer),
        tiles=gluon_tiles(kernel, spec, dscore_one, whole_tiles, three, gathers) if gluon else
        {fn: choose_tiles(fn, spec, block_sparse, mask_class) for fn in _tiled(fns)},
        mods=mods, row_dots=row_dots,
        bounds=tile_bounds, grads=grads,
        log2_bias=log2_bias, split_bias=parts is not None,
        atomic_dq=spec.atomic_dq, dropout=spec.dropout, deterministic=spec.deterministic,
        split_d=split_dim(spec.head_dim),
        tma=tma, ws=ws, ws_kv=ws_limit,
        block_sparse=block_sparse and kernel != "kv", class_per_head=block_sparse and bool({"b", "h"} & set(f.mask_reads)),
        flat_group=spec.group > 1 and "h" not in f.mask_reads and not block_sparse, short_kv=short,
        pdl=kernel == "kv" and sm(spec.target) >= 90, tier="gluon" if gluon else "triton",
        row_keep=_row_keep(keep, *((Q, KV) if kernel == "fwd" else (KV, Q)), tp) if gluon and keep is not None else None,
        offsets=gluon and spec.offsets, probs_in_pairs=probs_in_pairs, row_max_tree=row_max_tree,
        pack_gqa=spec.group if packs else 1,
        lane_compares=three or (kernel == "fwd" and gluon and mask_class == "banded" and spec.head_dim == 128),
        dscore_late=of_value is not None,
        band=_band(keep) if kernel == "fwd" and gluon and keep is not None else 0)


def _tiled(fns) -> list:
    """Kernel functions that get tiles: the inference kernel has a decoding shape too."""
    return [g for fn in fns for g in ((fn, "attn_kv_decode") if fn == "attn_kv" else (fn,))]

