"""KernelPlan: the one frozen object a template sees, built from a variant's analysis and a Spec."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy as sp

from . import __version__, config, printer
from .log import logger
from .passes import bounds as bounds_pass
from .passes import derive as derive_pass
from .passes.symbolic import H, KV, Q, SCORE
from .spec import Spec  # noqa: F401  (re-exported: plan.Spec)
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
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


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
    # score_mod = score + bias: the mods compute bias * log2(e) ("bias") and the kernels take
    # s = q.k * (scale * log2(e)) + bias, one FMA per score for the scale, the bias and the change
    # to log2 units (backward and decode kernels, see build)
    log2_bias: bool = False
    block_sparse: bool = False    # the mask reads captured tensors: precomputed tile lists drive the loops
    class_per_head: bool = False  # ... and reads b or h, so each (b, h) has its own tile classes
    atomic_dq: bool = False  # bwd: dq by atomic adds from the dK/dV kernel instead of its own kernel
    dropout: bool = False     # the Philox dropout mask is compiled in
    deterministic: bool = False  # capture gradients accumulate as int64 fixed point (bitwise reproducible)
    split_d: tuple = (16, 0)  # kv: the head dim in two power-of-two pieces (split_dim)
    tma: bool = False         # fwd: K and V are tensor descriptors (TMA loads, zero-filled past the ends)
    # fwd, no mask: when the keys fill whole tiles, one key loop that Triton warp-specialises on
    # Hopper (a producer warp streams K/V through descriptors built on the device, two consumer
    # warp groups of 64 rows compute), with its own warps and stages (tiles["attn_fwd_ws"])
    ws: bool = False
    # bwd, GQA: the dK/dV kernel runs the (query tile, query head) pairs of its group in one loop
    # per class of tile, not the tile loops inside a loop over heads, which spilled ~300 registers
    # at head dim 128 (H200, triton 3.6). Needs tile bounds that do not depend on h; data-dependent
    # masks keep the loop over heads (it spilled less there).
    flat_group: bool = False
    # fwd: keys up to which the launch takes the smaller tiles["attn_fwd_short"] (0: never), see
    # short_kv below
    short_kv: int = 0

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


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def split_dim(n: int) -> tuple:
    """A head dim as two power-of-two pieces (the second 0 when one suffices): 576 -> (512, 64),
    80 -> (64, 16); the inference kernel loads and dots them separately instead of padding."""
    if n <= 16 or n & (n - 1) == 0:
        return _pow2(n), 0
    first = 1 << (n.bit_length() - 1)
    return first, _pow2(n - first)


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
    d = max(_pow2(spec.head_dim), _pow2(spec.head_dim_v))
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


def ws_fits(facts, block_sparse: bool, spec: Spec) -> bool:
    """The warp-specialised loop has no mask code: variants without a mask or dropout."""
    return facts.mask_trivial and not block_sparse and not spec.dropout


def ws_pays(facts, spec: Spec) -> bool:
    """Whether the forward warp-specialises under ATTNCC_WS=auto: where it measured faster. H200,
    bf16, full attention, forward ms with ATTNCC_WS=off -> auto: 0.345 -> 0.342 (16x16x1024x128),
    1.122 -> 1.046 (4x16x4096x128), 4.28 -> 3.99 (1x16x16384x128); a standalone kernel at head
    dim 64 was slower (1.30 -> 1.41 at 4x32x4096x64). Triton 3.6 warp-specialises only a loop
    whose loads all go through descriptors built on the device, with 4 warps per group (8 warps
    compile unspecialised)."""
    d = max(_pow2(spec.head_dim), _pow2(spec.head_dim_v))
    return (spec.target.startswith("cuda-sm9") and spec.dtype in ("bfloat16", "float16") and d == 128
            and facts.score_identity)


# the warp-specialised forward with 128x64 tiles and 3 stages gave wrong results on an H200
# (triton 3.6; found by the autotuner's check against the table's tiles): cap requests for more
WS_MAX_STAGES = 2
LOG2E = sp.Float(1.4426950408889634)  # exp(x) = exp2(x * log2(e))
SHORT_KV = (2048, 4096)  # keys up to which causal-like masks take short forward tiles: (identity
                         # score_mod, score_mod without per-entry gathers), see short_kv


def short_kv(facts, score, block_sparse: bool, mask_class: str, spec: Spec) -> int:
    """Keys up to which a forward with a mask that cuts tiles (causal-like: neither banded nor
    data-dependent) launches 64x64 tiles instead of 128x128 at head dims 65..128: fewer masked
    entries computed on the tiles the diagonal crosses. H200, bf16, forward ms 128x128 -> 64x64
    (benchmarks/tune_sweep.py): at 1024 keys causal 0.250 -> 0.217, ALiBi 0.256 -> 0.211,
    softcap 0.275 -> 0.226, GQA 0.246 -> 0.214, prefix-LM 0.339 -> 0.326, dropout 0.314 -> 0.292;
    at 2048 1.02-1.14x; at 4096 ALiBi 0.694 -> 0.629 and softcap 0.758 -> 0.692, but prefix-LM
    0.95x, dropout and GQA 0.99x, so only score mods keep them to 4096; at 16k causal and dropout
    0.91x. A score_mod that gathers a captured tensor per entry (a relative-position table) was
    slower with them (0.586 -> 0.702 ms at 1024) and keeps 128x128. The interpreter takes 16x32
    tiles up to 64 keys, so that CPU tests run this launch path. Off when tiles are chosen
    otherwise (autotuner, ATTNCC_TILES)."""
    if facts.mask_trivial or block_sparse or mask_class != "masked" or spec.tiles or config.tile_overrides():
        return 0
    if spec.target == "interpreter":
        return 64
    d = max(_pow2(spec.head_dim), _pow2(spec.head_dim_v))
    if spec.dtype == "float32" or d != 128 or _gathers_per_entry(score):
        return 0
    return SHORT_KV[0] if facts.score_identity else SHORT_KV[1]


def _gathers_per_entry(expr) -> bool:
    """A captured tensor read at an index that changes with q_idx or kv_idx."""
    return any({Q, KV} & set().union(*(a.free_symbols for a in load.args))
               for load in expr.atoms(sp.core.function.AppliedUndef))


def _base_tiles(fn: str, spec: Spec) -> Tiles:
    override = config.tile_overrides().get(fn)
    if override and spec.target != "interpreter":
        return Tiles(*override)
    if spec.target == "interpreter":
        # small tiles keep several tiles and ragged edges in tests
        return Tiles(16, 32, 1, 1) if fn in ("attn_kv_decode", "attn_fwd_short") else Tiles(32, 32, 1, 1)
    d = max(_pow2(spec.head_dim), _pow2(spec.head_dim_v))
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


def _label(cap, i) -> str:
    """A readable Python name for a capture's loads in generated code."""
    name = getattr(cap, "name", None)
    return name if name and name.isidentifier() and not name.startswith("cap") and len(name) < 24 else f"cap{i}_"


def _describe(i, ndim, kind, cap, facts) -> str:
    users = [n for n, caps in (("score_mod", facts.captures_in_score), ("mask_mod", facts.captures_in_mask))
             if i in caps]
    label = f"`{cap.name}` " if cap is not None and cap.name else ""
    return f"{label}{kind} tensor, {ndim}-d, read by {' and '.join(users) or 'nothing'}"


def _offset_and_bounds(index, capture, printer_):
    offset = " + ".join(f"({printer_.doprint(i)}).to(tl.int64) * dcap{capture}_stride{d}"
                        for d, i in enumerate(index)) or "0"
    bounds = [f"({printer_.doprint(i)} >= 0) & ({printer_.doprint(i)} < cap{capture}_size{d})"
              for d, i in enumerate(index)]
    return offset, bounds


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
        diag_offset, diag_bounds = _offset_and_bounds([i.xreplace(at) for i in index], g.capture, printer_)
        diag_mask = printer_.as_bool(" & ".join(diag_bounds))
    # rows / columns that exist: what the sum did not already fold away
    valid = {"both": [], "kv": ["row_ok"], "q": ["col_ok"], "none": ["valid"], "diag": ["valid"]}[reduce]
    mask = printer_.as_bool(" & ".join(valid + bounds)) if valid + bounds else "None"
    return CapGrad(g.capture, f"dcap{j}", offset, mask, reduce, diag_offset, diag_mask)


def build(kernel: str, analysis: Analysis, spec: Spec, captures=()) -> KernelPlan:
    """The plan for the forward ('fwd') or backward ('bwd') kernels of a variant under a Spec."""
    f = analysis.facts
    score = None if f.score_identity else analysis.score
    keep = None if f.mask_trivial else analysis.mask
    labels = [_label(captures[i] if i < len(captures) else None, i) for i in range(len(analysis.captures))]
    cap_info = tuple((nd, kind, lab) for (nd, kind), lab in zip(analysis.captures, labels))
    # The backward and decode kernels take an additive bias in log2 units over float positions
    # (s = q.k * scale * log2(e) + bias). Same-run A/B on an H200 (bf16, ALiBi-causal, against
    # the score_mod form with integer positions): backward 2.02 -> 1.97 ms at 4x16x4096x128
    # (1.967 -> 1.953 in a second A/B) and 0.709 -> 0.697 at 16x16x1024x128, unchanged at head
    # dim 64; the forward 0.62 -> 0.65 and 0.218 -> 0.221, so the forward keeps the score_mod
    # form. A bias that gathers a captured tensor per score (a relative-position table) keeps it
    # everywhere: one cross-run reading had its backward slower with the log2 form, never
    # rechecked side by side.
    log2_bias = kernel != "fwd" and score is not None and f.score_bias and not _gathers_per_entry(score)
    outputs = []
    if score is not None:
        outputs.append(("bias", LOG2E * (score - SCORE)) if log2_bias else ("score_mod", score))
    if kernel != "fwd":
        outputs = [(label, printer.float_positions(e)) for label, e in outputs]
    if keep is not None:
        outputs.append(("keep", keep))
    grads = ()
    interp = spec.target == "interpreter"
    if kernel == "fwd":
        fns = {"attn_fwd": {KV}}
    elif kernel == "kv":
        fns = {"attn_kv": {KV}}
    else:
        derived = derive_pass.derive(analysis.score, spec.learnable)
        if not f.score_identity and derived.dscore != 1:
            outputs.append(("dscore", printer.float_positions(derived.dscore)))
        outputs += [(f"dcap{j}", printer.float_positions(g.derivative)) for j, g in enumerate(derived.loads)]
        grads = tuple(_cap_grad(g, j, printer.TritonPrinter(cap_info, interp)) for j, g in enumerate(derived.loads))
        fns = {"attn_bwd_dkdv": {Q}, "attn_bwd_dq": {KV}, "attn_bwd_preprocess": set()}
    mods = {fn: printer.emit(outputs, cap_info, loop, interp) for fn, loop in fns.items() if loop}
    tp = printer.TritonPrinter(cap_info, interp)
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
    fwd_bounds = tile_bounds.get("attn_fwd") or tile_bounds.get("attn_bwd_dq")  # queries outer, keys inner
    mask_class = ("none" if f.mask_trivial else
                  "banded" if fwd_bounds is not None and fwd_bounds.reach_first is not None else "masked")
    if block_sparse and kernel == "fwd":
        mods["block_classes"] = printer.emit([("keep", mask)], cap_info, set(), interp)
    caps = tuple(
        CaptureArg(i, nd, kind, _describe(i, nd, kind, captures[i] if i < len(captures) else None, f))
        for i, (nd, kind) in enumerate(analysis.captures))
    d = max(_pow2(spec.head_dim), _pow2(spec.head_dim_v))
    ws = kernel == "fwd" and ws_fits(f, block_sparse, spec) and (
        spec.ws == "on" or (spec.ws == "auto" and ws_pays(f, spec)))
    tma = kernel == "fwd" and not ws and (
        spec.tma == "on" or (spec.tma == "auto" and tma_pays(f, block_sparse, mask_class, d)))
    short = short_kv(f, analysis.score, block_sparse, mask_class, spec) if kernel == "fwd" and not ws else 0
    if ws:
        fns = {**fns, "attn_fwd_ws": set()}
    if short:
        fns = {**fns, "attn_fwd_short": set()}
    return KernelPlan(
        kernel=kernel, attncc_version=__version__, target=spec.target, dtype=spec.dtype,
        head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
        block_d=_pow2(spec.head_dim), block_dv=_pow2(spec.head_dim_v), group=spec.group,
        dot_precision="ieee" if spec.dtype == "float32" else "tf32",
        score_text=str(analysis.score), mask_text=str(analysis.mask),
        score_identity=f.score_identity, dscore_one=f.score_bias, captures=caps,
        fold_scale=f.score_identity and spec.positive_scale and (kernel == "kv" or (kernel == "fwd" and (tma or ws or d <= 64))),
        score_broadcast=SCORE not in analysis.score.free_symbols or bool(analysis.score.is_integer),
        tiles={fn: choose_tiles(fn, spec, block_sparse, mask_class) for fn in _tiled(fns)}, mods=mods,
        bounds=tile_bounds, grads=grads,
        log2_bias=log2_bias, atomic_dq=spec.atomic_dq, dropout=spec.dropout, deterministic=spec.deterministic,
        split_d=split_dim(spec.head_dim),
        tma=tma, ws=ws,
        block_sparse=block_sparse and kernel != "kv", class_per_head=block_sparse and bool({"b", "h"} & set(f.mask_reads)),
        flat_group=spec.group > 1 and "h" not in f.mask_reads and not block_sparse, short_kv=short)


def _tiled(fns) -> list:
    """Kernel functions that get tiles: the inference kernel has a decoding shape too."""
    return [g for fn in fns for g in ((fn, "attn_kv_decode") if fn == "attn_kv" else (fn,))]

