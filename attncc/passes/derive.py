"""Symbolic derivatives of score_mod for the backward kernels.

For s' = score_mod(s, b, h, q_idx, kv_idx) and dL/ds' = dS' (what softmax backward gives,
P * (dP - D)), the kernels need

    dL/ds      = dS' * d score_mod / d score           (then dq = dS k * scale, dk = dS^T q * scale)
    dL/dcap[i] = sum over (q, kv) of dS' * d score_mod / d cap(i)   for each load site cap(i)

sympy differentiates the simplified expression: where() on the score is differentiated branch
by branch (Piecewise), floor, ceil, round, trunc and sign have derivative 0 (as in torch), and the printer shares
subexpressions with the recomputed forward value (softcap's tanh appears once).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy as sp
from sympy.core.function import AppliedUndef

from ..errors import AttnccError
from .symbolic import KV, Q, SCORE, rint, trunc

# score_mod's value in log2 units, score_mod * log2(e), where the backward recovers it from P: log2(P) + lse2
SCORE_MOD_LOG2 = sp.Symbol("score_mod_log2", real=True)


@dataclass(frozen=True)
class LoadGrad:
    """One place a score_mod reads a learnable captured tensor, and d score_mod / d value there."""
    capture: int
    load: sp.Expr        # the load, e.g. cap0(h)
    derivative: sp.Expr  # d score_mod / d load


@dataclass(frozen=True)
class Gradients:
    dscore: sp.Expr
    loads: tuple  # LoadGrad per differentiated load site


def _diff(expr, var) -> sp.Expr:
    d = sp.diff(expr, var)
    # floor, ceil, trunc and sign are piecewise constant: torch gives them zero gradient (sympy
    # differentiates sign into a DiracDelta, nonzero only where the argument is 0).
    d = d.replace(lambda e: isinstance(e, sp.Derivative) and isinstance(e.expr, (sp.floor, sp.ceiling, trunc, rint)),
                  lambda e: sp.S.Zero)
    d = d.replace(lambda e: isinstance(e, sp.DiracDelta), lambda e: sp.S.Zero)
    # the chain rule through floor(3 * score) leaves Subs(0, ...) behind
    d = d.replace(lambda e: isinstance(e, sp.Subs), lambda e: e.doit())
    if d.has(sp.Derivative):
        raise AttnccError(f"cannot differentiate score_mod {expr} with respect to {var}: {d}")
    return d


def load_sites(expr: sp.Expr, capture: int) -> list:
    """Every distinct load of capture number ``capture`` in an expression."""
    return sorted({f for f in expr.atoms(AppliedUndef) if f.func.__name__ == f"cap{capture}"}, key=sp.default_sort_key)


def derive(score: sp.Expr, learnable: tuple = ()) -> Gradients:
    """d score_mod / d score and d score_mod / d load for each load of the ``learnable`` captures."""
    loads = tuple(LoadGrad(c, site, _diff(score, site)) for c in learnable for site in load_sites(score, c))
    return Gradients(_diff(score, SCORE), loads)


def dscore_of_value(score: sp.Expr, dscore: sp.Expr):
    """d score_mod / d score written over score_mod's value (SCORE_MOD_LOG2, in log2 units) instead
    of the score, or None. Where score_mod = A + B * f(u), f(u) the one function application that
    reads the score, A free of it, B a number (|B| >= 0.1), and dscore reads the score only through
    f(u) (tanh' = 1 - tanh^2, exp' = exp, sigmoid' = sigmoid (1 - sigmoid)), f(u) = (value - A) / B:
    softcap's 1 - tanh(score / c)^2 becomes 1 - (value / c)^2. The backward then need not keep
    dscore's registers from the score's step to dS: it recomputes dscore from P."""
    reading = [e for e in score.atoms(sp.Function) if SCORE in e.free_symbols]
    if len(reading) != 1:
        return None
    inner = sp.Dummy("f")
    outer = score.xreplace({reading[0]: inner})
    slope = sp.diff(outer, inner)
    # f(u) = (value - A) / B carries the value's error (float32 rounding of lse2, lg2.approx: about
    # 1e-6 in log2 units) divided by B: a B below 0.1 would make dscore's error that much larger
    if SCORE in outer.free_symbols or not slope.is_number or abs(float(slope)) < 0.1:
        return None
    value = dscore.xreplace({reading[0]: (SCORE_MOD_LOG2 * (1 / math.log2(math.e)) - outer.subs(inner, 0)) / slope})
    return None if SCORE in value.free_symbols else value


def split_bias(bias: sp.Expr):
    """(the terms of ``bias`` that read q_idx, the others) where no term reads both q_idx and kv_idx
    (ALiBi's slope * (kv_idx - q_idx)); None otherwise (a table at q_idx - kv_idx, |q_idx - kv_idx|)."""
    terms = sp.Add.make_args(sp.expand(bias))
    if any({Q, KV} <= t.free_symbols for t in terms):
        return None
    return sp.Add(*[t for t in terms if Q in t.free_symbols]), sp.Add(*[t for t in terms if Q not in t.free_symbols])
