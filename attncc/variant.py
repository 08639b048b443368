"""Variant: an attention variant as traced IR, plus the analysis every kernel of it shares."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cached_property

from typing import TYPE_CHECKING

from . import ir
from .errors import AttnccError
from .log import logger
from .passes import ranges
from .trace import trace

if TYPE_CHECKING:  # sympy and the passes load with the first analysis, not at import
    import sympy as sp

    from .passes import facts as facts_pass


@dataclass(frozen=True)
class Analysis:
    """What the passes derive from a variant's IR; independent of dtype, shapes and tensors."""
    score: sp.Expr          # simplified score_mod
    mask: sp.Basic          # simplified mask_mod (sympy.true when there is none)
    facts: facts_pass.Facts
    captures: tuple         # (ndim, kind) per capture number
    key: str                # canonical text: equal keys, equal kernels


def check_dropout(p) -> float:
    """``p`` rounded to a multiple of 1/256 (at most 255 / 256), the probability the kernels apply:
    they compare 8-bit random numbers, 16 per Philox call (as FlashAttention-2 does); the change
    is at most 1/512. AttnccError unless p is a number in [0, 1)."""
    if not isinstance(p, (int, float)) or not 0.0 <= float(p) < 1.0:
        raise AttnccError(f"dropout_p must be a number in [0, 1), got {p!r}; it is the probability of "
                          "dropping an attention weight (0.0 turns dropout off)")
    return min(round(float(p) * 256), 255) / 256


def check_scale(scale):
    """``scale`` as a float (None stays None: 1/sqrt(head_dim) at call time); AttnccError unless
    it is a finite Python number."""
    if scale is None:
        return None
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise AttnccError(f"scale must be a finite Python number (or None for 1/sqrt(head_dim)), got {scale!r}")
    return float(scale)


def _simplified(root: ir.Node, capture_index: dict) -> sp.Basic:
    import sympy as sp

    from .passes import symbolic
    try:
        return symbolic.canonicalize(symbolic.to_sympy(root, capture_index))
    except ZeroDivisionError:  # sympy's Mod(x, 0)
        return sp.zoo


def _undefined(e) -> bool:
    """The simplified expression holds a value that is undefined for every score: 1/0 (zoo),
    0/0 or inf * 0 (nan), or an integer division or remainder by 0 that sympy keeps whole."""
    import sympy as sp

    from .passes import symbolic
    if e is sp.zoo or e is sp.nan:
        return True
    if not isinstance(e, sp.Basic):
        return False
    if e.has(sp.zoo, sp.nan):
        return True
    return any(n.args[1] == 0 for n in e.atoms(symbolic.floordiv, symbolic.intdiv, sp.Mod))


def _undefined_message(kind: str, root: ir.Node, capture_index: dict) -> str:
    """What makes ``root`` undefined, named at its innermost undefined node, and the fix."""
    culprit = next((n for n in ir.walk(root) if _undefined(_simplified(n, capture_index))), root)
    text = ir.to_text(culprit)
    if culprit.op in ("truediv", "floordiv", "mod"):
        return (f"{kind} divides by an expression that is always 0: {text} in {ir.to_text(root)}; a mod must "
                "divide by non-zero values")
    if culprit.op == "mul":
        return (f"{kind} multiplies infinity by an expression that is always 0: {text} in {ir.to_text(root)}; "
                "inf * 0 is NaN (in torch too). To set scores to -inf where a condition holds, select them: "
                "torch.where(condition, float('-inf'), score)")
    if culprit.op in ("add", "sub"):
        return (f"{kind} adds infinities of opposite signs: {text} in {ir.to_text(root)}; inf - inf is NaN "
                "(in torch too). Select the value you mean with torch.where")
    return (f"{kind} has no defined value for any score at {text} in {ir.to_text(root)}; select a defined "
            "value with torch.where")


def _name_of(fn) -> str | None:
    if fn is None or isinstance(fn, ir.Node):
        return None
    name = getattr(fn, "__name__", None)
    return None if name in (None, "<lambda>") else name


class Variant:
    """An attention variant: score_mod and mask_mod traced into IR, plus scale and dropout.

    score_mod(score, b, h, q_idx, kv_idx) -> score and mask_mod(b, h, q_idx, kv_idx) -> bool
    follow FlexAttention; either may also be an ``attncc.ir`` expression. Tensors the mods
    read are captured by reference: changing their contents needs no new kernel. ``scale``
    defaults to 1/sqrt(head_dim). ``dropout_p`` applies in training calls (``training=False``
    turns it off), rounded to a multiple of 1/256 (``check_dropout``); ``deterministic=True``
    makes gradients bitwise reproducible (the default dQ kernel already is; it forbids the
    atomic dQ path).

    Integer ``//`` and ``%`` round toward -inf, as in torch and Python. A divisor that is 0 for
    some positions (``q_idx % (kv_idx - q_idx)`` on the diagonal) gives ``x // 0 == 0`` and
    ``x % 0 == x`` there, where torch raises on CPU: one rule that the kernels apply on every
    score for a compare and a select, that the reference (attncc.reference) shares, and that
    keeps ``x == (x // y) * y + x % y``. A divisor that is always 0 is refused (AttnccError).

    Construction traces the mods and checks everything that needs no inputs: the mods' arity,
    return types and the operations they use (AttnccError, ModTraceError for Python control flow
    on traced values), a finite ``scale`` and ``dropout_p`` in [0, 1). Shapes, dtypes, devices
    and captured-tensor index ranges are checked per call (``attncc.checks``).
    """

    def __init__(self, score_mod=None, mask_mod=None, *, scale=None, dropout_p=0.0, name=None,
                 deterministic=False):
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.scale = check_scale(scale)
        self.dropout_p = check_dropout(dropout_p)
        self.deterministic = bool(deterministic)
        self.score_ir = ir.score if score_mod is None else trace(score_mod, "score_mod")
        self.mask_ir = None if mask_mod is None else trace(mask_mod, "mask_mod")
        self.captures = ir.captures(self.score_ir, self.mask_ir)
        parts = [n for n in (_name_of(score_mod), _name_of(mask_mod)) if n]
        self.name = name or "+".join(parts) or ("full" if score_mod is None and mask_mod is None else "variant")
        self.index_checked: set = set()  # (lengths, mode, capture shapes) that passed the index check
        self.in_range: dict = {}  # (lengths, capture shapes) -> captures read inside (checks.captures_in_range)

    @cached_property
    def ir_key(self) -> str:
        """Canonical text of the traced IR: variants with equal keys share kernels, whichever
        tensors they capture (captures are named by order of appearance)."""
        return ir.canonical_key(self.score_ir, self.mask_ir)

    @cached_property
    def index_sites(self) -> tuple:
        """Every captured-tensor index the kernels read unconditionally, classified by how it is
        checked against the tensor's shape per call (``attncc.passes.ranges``)."""
        return ranges.index_sites((self.score_ir, self.mask_ir), self.captures)

    @cached_property
    def load_sites(self) -> tuple:
        """``index_sites`` and the indices read inside a branch of ``torch.where`` too: every index
        the kernels evaluate (``attncc.checks.captures_in_range``)."""
        return ranges.index_sites((self.score_ir, self.mask_ir), self.captures, guarded=True)

    @cached_property
    def analysis(self) -> Analysis:
        """The sympy passes' results (simplified expressions, derived facts, canonical key); run
        once, on the first kernel this variant generates."""
        import sympy as sp

        from .passes import facts as facts_pass
        from .passes import symbolic
        start = time.perf_counter()
        index = {c: i for i, c in enumerate(self.captures)}
        score = _simplified(self.score_ir, index)
        mask = sp.true if self.mask_ir is None else _simplified(self.mask_ir, index)
        for kind, e, src in (("score_mod", score, self.score_ir), ("mask_mod", mask, self.mask_ir)):
            if src is not None and _undefined(e):
                raise AttnccError(_undefined_message(kind, src, index))
        caps = tuple((c.ndim, c.kind) for c in self.captures)
        key = f"score={symbolic.canonical(score)}|mask={symbolic.canonical(mask)}|caps={caps}"
        result = Analysis(score, mask, facts_pass.derive(score, mask), caps, key)
        logger.info("analysed variant %r (sympy passes) in %.0f ms", self.name, 1e3 * (time.perf_counter() - start))
        return result

    def capture_names(self) -> dict:
        """{Capture: 'capN'}: the names the kernels and explain() give the captured tensors."""
        return {c: f"cap{i}" for i, c in enumerate(self.captures)}

    def __repr__(self):
        names = self.capture_names()
        mask = "None" if self.mask_ir is None else ir.to_text(self.mask_ir, names)
        return (f"Variant({self.name!r}, score_mod={ir.to_text(self.score_ir, names)}, mask_mod={mask}, "
                f"scale={self.scale}, dropout_p={self.dropout_p})")
