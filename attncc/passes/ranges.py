"""Value ranges of IR expressions by interval arithmetic, for checking captured-tensor indices.

``interval(node, leaves)`` bounds an expression given ranges of its leaves: inclusive
``(lo, hi)`` pairs of Python numbers, ``math.inf`` where unbounded. Every rule is conservative
(the true range lies inside the result) and cheap: one walk over the expression, no sympy.
Operations without a useful rule (a load of an int tensor, exp, a power) give (-inf, inf), so an
index that reads one is simply not bounded.

``index_sites`` lists, once per variant, every captured-tensor index the kernels evaluate for
every score, classified by how attncc checks it against the tensor's shape at call time:

    axis      a bare leaf (``slopes[h]``, ``doc_ids[q_idx]``): the dimension must cover the
              whole axis (B, Hq, Lq or Lkv entries)
    bounded   an index the mod bounds itself, whatever the lengths (``x.clamp(0, 63)``,
              ``x % 16``, ``x & 7`` and sums of them with constants): its range at the call's
              lengths must lie inside the dimension
    shifted   any other index of the leaves (``kv_idx - 5``, ``q_idx - kv_idx + L - 1``): reads
              outside the tensor give 0 (padding; positions a mask removes); checked only with
              ATTNCC_INDEX_CHECK=all, and then only its upper end
    data      an index that reads a captured tensor or the score: never checked (it would
              need the tensor's values)

Loads inside a branch of ``torch.where`` are never checked: the condition may guard them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import ir

INF = math.inf
EVERYTHING = (-INF, INF)
INDEX_LEAVES = ("b", "h", "q_idx", "kv_idx")


def _mul(x: float, y: float) -> float:
    return 0.0 if x == 0 or y == 0 else x * y  # 0 * inf: a bound of 0 times anything finite


def _const_value(n: ir.Node):
    return n.value if n.op == "const" and not isinstance(n.value, bool) else None


def _floor(x: float) -> float:
    return x if math.isinf(x) else math.floor(x)


def _trunc(x: float) -> float:
    return x if math.isinf(x) else math.trunc(x)


def _rule(n: ir.Node, a: list) -> tuple:
    """The range of node ``n`` from its arguments' ranges ``a``."""
    op = n.op
    if n.type == ir.BOOL:
        return (0, 1)
    if op == "const":
        return (n.value, n.value)
    if op == "load":
        return EVERYTHING
    if op == "add":
        return (a[0][0] + a[1][0], a[0][1] + a[1][1])
    if op == "sub":
        return (a[0][0] - a[1][1], a[0][1] - a[1][0])
    if op == "neg":
        return (-a[0][1], -a[0][0])
    if op == "mul":
        p = [_mul(x, y) for x in a[0] for y in a[1]]
        return (min(p), max(p))
    if op == "minimum":
        return (min(a[0][0], a[1][0]), min(a[0][1], a[1][1]))
    if op == "maximum":
        return (max(a[0][0], a[1][0]), max(a[0][1], a[1][1]))
    if op == "abs":
        lo, hi = a[0]
        if lo >= 0:
            return (lo, hi)
        return (-hi, -lo) if hi <= 0 else (0, max(-lo, hi))
    if op == "where":
        return (min(a[1][0], a[2][0]), max(a[1][1], a[2][1]))
    if op in ("floor", "cast"):  # both monotone; a cast to int truncates toward zero
        f = _floor if op == "floor" else (_trunc if n.type == ir.INT and n.args[0].type == ir.FLOAT else None)
        return a[0] if f is None else (f(a[0][0]), f(a[0][1]))
    if op == "invert":  # ~x == -x - 1 on integers
        return (-a[0][1] - 1, -a[0][0] - 1)
    if op in ("tanh", "sin", "cos", "erf", "sign"):
        return (-1, 1)
    if op == "sigmoid":
        return (0, 1)
    if op == "atan":
        return (-math.pi / 2, math.pi / 2)
    if op in ("ceil", "round", "trunc"):  # monotone
        f = {"ceil": math.ceil, "round": round, "trunc": math.trunc}[op]
        return tuple(x if math.isinf(x) else f(x) for x in a[0])
    c = _const_value(n.args[1]) if len(n.args) == 2 else None
    if c is None or c == 0:
        return EVERYTHING
    if op in ("floordiv", "truediv"):
        div = (lambda x: _floor(x / c)) if op == "floordiv" else (lambda x: x / c)
        ends = (div(a[0][0]), div(a[0][1]))
        return (min(ends), max(ends))
    if op == "mod":  # torch's %: the sign of the divisor
        lo, hi = a[0]
        if n.type == ir.INT and c > 0 and 0 <= lo and hi < c:
            return (lo, hi)
        if n.type == ir.INT:
            return (0, c - 1) if c > 0 else (c + 1, 0)
        return (0, c) if c > 0 else (c, 0)
    if op == "and" and n.type == ir.INT and c >= 0:  # x & c lies in [0, c] for c >= 0
        return (0, c)
    if op in ("lshift", "rshift") and isinstance(c, int) and 0 <= c < 31:  # x * 2**c, floor(x / 2**c)
        f = (lambda x: x * 2 ** c) if op == "lshift" else (lambda x: _floor(x / 2 ** c))
        return (f(a[0][0]), f(a[0][1]))
    if op == "fmod":  # the sign of the dividend, smaller than |c|
        m = abs(c) - 1 if n.type == ir.INT else abs(c)
        lo, hi = a[0]
        return (0 if lo >= 0 else -m, 0 if hi <= 0 else m)
    return EVERYTHING


def interval(root: ir.Node, leaves: dict) -> tuple:
    """(lo, hi) bounding every value of ``root`` when each leaf ``name`` lies in ``leaves[name]``
    (leaves not given, like ``score``, are unbounded)."""
    memo = {}
    for n in ir.walk(root):
        if n.op in ir.LEAVES:
            r = leaves.get(n.op, EVERYTHING)
        else:
            r = _rule(n, [memo[x] for x in n.args])
        memo[n] = EVERYTHING if any(math.isnan(x) for x in r) else r
    return memo[root]


@dataclass(frozen=True)
class IndexSite:
    """Dimension ``dim`` of captured tensor number ``capture`` is read at ``index``."""
    capture: int
    dim: int
    index: ir.Node
    kind: str  # "axis", "bounded", "shifted" or "data" (see the module docstring)


def _kind(index: ir.Node) -> str:
    if index.op in INDEX_LEAVES:
        return "axis"
    ops = {n.op for n in ir.walk(index)}
    if "load" in ops or "score" in ops:
        return "data"
    lo, hi = interval(index, {leaf: (0, INF) for leaf in INDEX_LEAVES})
    return "bounded" if math.isfinite(lo) and math.isfinite(hi) else "shifted"


def index_sites(roots, captures, guarded: bool = False) -> tuple:
    """Every (capture, dimension, index) the kernels read unconditionally, classified; with
    ``guarded``, also those inside a branch of ``torch.where`` (the kernels evaluate both)."""
    number = {c: i for i, c in enumerate(captures)}
    sites, seen = [], set()

    def visit(n: ir.Node, under_where: bool):
        if (n, under_where) in seen:
            return
        seen.add((n, under_where))
        if n.op == "load" and not under_where:
            for d, i in enumerate(n.args):
                site = IndexSite(number[n.value], d, i, _kind(i))
                if site not in sites:
                    sites.append(site)
        for j, arg in enumerate(n.args):
            visit(arg, under_where or (n.op == "where" and j > 0 and not guarded))
    for r in roots:
        if r is not None:
            visit(r, False)
    return tuple(sites)
