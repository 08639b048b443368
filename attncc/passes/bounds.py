"""Tile ranges derived from the mask predicate, so kernels skip masked tiles without a block mask.

For a tile of the outer index (the Q tile [lo, hi] in the forward) the kernels need, along the
inner index (kv_idx):

    reach   every kv some query of the tile may attend   (tiles outside it are skipped)
    full    every kv all queries of the tile attend      (tiles inside it run without mask code)

Both are intervals [first, last] of sympy expressions in the outer tile's bounds (and in b, h,
or loads that read only them). They are derived from the mask's structure: each comparison
that is linear in q_idx and kv_idx, ``a*outer + c*inner + d >= 0`` with numeric a and c,
bounds the inner index by a half-line (``|x| <= w`` counts as ``-w <= x <= w``); ``&``
intersects, ``|`` joins, ``~`` is pushed into the comparisons. Anything else (a load of kv_idx,
%, ==) gives no information: reach is
everything and full is nothing, which is always safe. Intervals are conservative: reach may be
too wide and full too narrow, never the opposite; the kernels still apply the mask on every
tile outside ``full``.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .symbolic import floordiv

INF = sp.oo


@dataclass(frozen=True)
class Interval:
    first: sp.Expr  # smallest inner index (may be -oo)
    last: sp.Expr   # largest inner index (may be +oo); empty when last < first

    @staticmethod
    def everything():
        return Interval(-INF, INF)

    @staticmethod
    def nothing():
        return Interval(INF, -INF)


@dataclass(frozen=True)
class TileBounds:
    reach: Interval
    full: Interval


def _ceil_div(x, c):
    return -floordiv(-x, c) if c != 1 else x


def _floor_div(x, c):
    return floordiv(x, c) if c != 1 else x


def _normalize(rel) -> list | None:
    """A comparison as a list of g >= 0 (conjunction), g integer-valued; None if not linear."""
    g = sp.expand(rel.lhs - rel.rhs)
    if isinstance(rel, sp.GreaterThan):
        return [g]
    if isinstance(rel, sp.StrictGreaterThan):
        return [g - 1]
    if isinstance(rel, sp.LessThan):
        return [-g]
    if isinstance(rel, sp.StrictLessThan):
        return [-g - 1]
    if isinstance(rel, sp.Equality):
        return [g, -g]
    return None


def _linear(g, outer, inner):
    """(a, c, d) with g == a*outer + c*inner + d, a and c numbers, d free of both; else None."""
    a, c = g.coeff(outer, 1), g.coeff(inner, 1)
    d = sp.expand(g - a * outer - c * inner)
    if not (a.is_Number and c.is_Number) or d.has(outer) or d.has(inner):
        return None
    if not (a.is_Integer and c.is_Integer):
        return None
    return int(a), int(c), d


def _atom(g, outer, inner, lo, hi, forall: bool) -> Interval:
    """The inner indices where g >= 0 holds for some (forall=False) or every outer in [lo, hi]."""
    lin = _linear(g, outer, inner)
    if lin is None:
        return Interval.nothing() if forall else Interval.everything()
    a, c, d = lin
    # pick the outer value that makes a*outer smallest (forall) or largest (exists)
    pick_hi = (a > 0) != forall
    rest = a * (hi if pick_hi else lo) + d
    if c == 0:
        return _all_or_nothing(rest >= 0)
    if c > 0:   # c*inner >= -rest
        return Interval(_ceil_div(-rest, c), INF)
    return Interval(-INF, _floor_div(rest, -c))   # -c*inner <= rest


def _all_or_nothing(ok) -> Interval:
    """Every inner index where ``ok`` holds, none otherwise (a condition free of the inner index)."""
    return Interval(sp.Piecewise((-INF, ok), (INF, True)), sp.Piecewise((INF, ok), (-INF, True)))


def _switch(x: Interval):
    """The condition of an _all_or_nothing interval; None for any other."""
    if isinstance(x.first, sp.Piecewise) and len(x.first.args) == 2 and x == _all_or_nothing(x.first.args[0].cond):
        return x.first.args[0].cond
    return None


def _min(x, y):
    if not (x.has(sp.Piecewise) or y.has(sp.Piecewise)):
        return sp.Min(x, y)
    # distribute over Piecewise branches first: sympy's Min(a, Piecewise(...)) can evaluate wrongly
    return sp.piecewise_fold(sp.Min(x, y, evaluate=False))


def _max(x, y):
    if not (x.has(sp.Piecewise) or y.has(sp.Piecewise)):
        return sp.Max(x, y)
    return sp.piecewise_fold(sp.Max(x, y, evaluate=False))


def _intersect(x: Interval, y: Interval) -> Interval:
    return Interval(_max(x.first, y.first), _min(x.last, y.last))


def _join(x: Interval, y: Interval, exact_only: bool) -> Interval:
    """Union hull; with exact_only (full tiles) only when it adds no index outside the union."""
    if not exact_only:
        return Interval(_min(x.first, y.first), _max(x.last, y.last))
    for a, b in ((x, y), (y, x)):
        ok = _switch(a)
        if ok is not None:  # e.g. prefix-LM's kv_idx < P for a K/V tile: every query or b's
            return Interval(sp.Piecewise((-INF, ok), (b.first, True)), sp.Piecewise((INF, ok), (b.last, True)))
    if x.first == y.first:
        return Interval(x.first, _max(x.last, y.last))
    if x.last == y.last:
        return Interval(_min(x.first, y.first), x.last)
    return x  # a subset of the union: conservative


def _negate(rel):
    return {sp.GreaterThan: sp.StrictLessThan, sp.StrictGreaterThan: sp.LessThan,
            sp.LessThan: sp.StrictGreaterThan, sp.StrictLessThan: sp.GreaterThan,
            sp.Equality: sp.Unequality, sp.Unequality: sp.Equality}[type(rel)](rel.lhs, rel.rhs)


def _split_abs(rel):
    """A comparison of |x| with a side free of |.| as comparisons of x (a symmetric window
    ``abs(q_idx - kv_idx) <= w`` is the band ``-w <= q_idx - kv_idx <= w``); None for any other."""
    lhs, rhs = rel.lhs, rel.rhs
    if isinstance(lhs, sp.Abs) and not rhs.has(sp.Abs):
        x, c, op = lhs.args[0], rhs, type(rel)
    elif isinstance(rhs, sp.Abs) and not lhs.has(sp.Abs):  # c op |x|: |x| (op reversed) c
        x, c = rhs.args[0], lhs
        op = {sp.GreaterThan: sp.LessThan, sp.StrictGreaterThan: sp.StrictLessThan, sp.LessThan: sp.GreaterThan,
              sp.StrictLessThan: sp.StrictGreaterThan, sp.Equality: sp.Equality, sp.Unequality: sp.Unequality}[type(rel)]
    else:
        return None
    return {sp.LessThan: lambda: sp.And(x <= c, x >= -c), sp.StrictLessThan: lambda: sp.And(x < c, x > -c),
            sp.GreaterThan: lambda: sp.Or(x >= c, x <= -c), sp.StrictGreaterThan: lambda: sp.Or(x > c, x < -c),
            sp.Equality: lambda: sp.Or(sp.Eq(x, c), sp.Eq(x, -c)),
            sp.Unequality: lambda: sp.And(sp.Ne(x, c), sp.Ne(x, -c))}[op]()


def interval(mask, outer, inner, lo, hi, forall: bool, negate: bool = False) -> Interval:
    """Inner indices that satisfy ``mask`` for some / every outer index in [lo, hi]."""
    if mask in (sp.true, sp.false):
        holds = (mask == sp.true) != negate
        return Interval.everything() if holds else Interval.nothing()
    if isinstance(mask, sp.Not):
        return interval(mask.args[0], outer, inner, lo, hi, forall, not negate)
    if isinstance(mask, (sp.And, sp.Or)):
        conj = isinstance(mask, sp.And) != negate
        parts = [interval(m, outer, inner, lo, hi, forall, negate) for m in mask.args]
        out = parts[0]
        for p in parts[1:]:
            # for "some outer", an And of atoms is over-approximated by the intersection
            out = _intersect(out, p) if conj else _join(out, p, exact_only=forall)
        return out
    if mask.is_Relational:
        split = _split_abs(mask) if mask.has(sp.Abs) else None
        if split is not None:
            return interval(split, outer, inner, lo, hi, forall, negate)
        rel = _negate(mask) if negate else mask
        gs = _normalize(rel)
        if gs is None:  # !=: two half-lines, the join of which says nothing useful
            return Interval.nothing() if forall else Interval.everything()
        out = Interval.everything()
        for g in gs:
            out = _intersect(out, _atom(g, outer, inner, lo, hi, forall))
        return out
    return Interval.nothing() if forall else Interval.everything()


def derive(mask, outer, inner, lo, hi) -> TileBounds:
    """Reach and full intervals along ``inner`` for outer indices in [lo, hi]."""
    return TileBounds(interval(mask, outer, inner, lo, hi, forall=False),
                      interval(mask, outer, inner, lo, hi, forall=True))


def row_interval(mask, outer, inner) -> Interval | None:
    """The inner indices ``mask`` keeps for one outer index, as an interval in terms of ``outer``,
    where that set is exactly the interval; else None (a comparison that is not linear, ``!=``,
    an ``|`` of parts apart). Derived for the one-index tile [outer, outer]: reach only widens the
    true set and full only narrows it, so where both give the same interval it is the set itself.
    A kernel then masks a score with two compares of its inner index against its row's ends
    (sliding window: ``kv_idx >= q_idx - 1023``, ``kv_idx < q_idx + 1``) instead of the mask's
    own expression."""
    tb = derive(mask, outer, inner, outer, outer)
    return tb.reach if tb.reach == tb.full else None

