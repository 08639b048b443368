"""Row products: torch.dot(a[q_idx], b[kv_idx]) (or a[q_idx] @ b[kv_idx], (a[q_idx] * b[kv_idx]).sum())
reaches the IR as R products a(q_idx, j) * b(kv_idx, j) (attncc.trace_vectors unrolls vector
reads), which cost R multiply-adds per score. Per tile they are one matrix product of a [rows, R]
tile of a and an [R, columns] tile of b: the tensor cores' work. ``find_row_dots`` finds them in
a kernel's printed expressions and puts a ``RowDot`` in their place, which the printer emits as
_row_dot (templates/header.py.jinja). Only the kernels' text changes: the reference, the
derivatives and the gradients of learnable captures keep the products.
"""
from __future__ import annotations

import sympy as sp
from sympy.core.function import AppliedUndef

from ..ir import FLOAT
from . import symbolic as S

ROW_DOT_MIN = 2  # rows this long or longer become tile products


class RowDot(sp.Function):
    """sum over j < length of cap<na>(*ia, j) * cap<nb>(*ib, j), where ia reads q_idx and not
    kv_idx and ib the other way round. Arguments: na, nb, length, Tuple(ia), Tuple(ib)."""
    is_real = True

    def side(self, k: int):
        return int(self.args[k]), tuple(self.args[3 + k])

    @property
    def length(self) -> int:
        return int(self.args[2])


def _row_factor(f, captures):
    """(capture number, leading index, j) of a load cap<n>(..., j) of a float capture, else None."""
    if not (isinstance(f, AppliedUndef) and f.func.__name__.startswith("cap") and f.args and f.args[-1].is_Integer):
        return None
    n = int(f.func.__name__[3:])
    return (n, tuple(f.args[:-1]), int(f.args[-1])) if captures[n][1] == FLOAT else None


def _side(index) -> str | None:
    """'q' for an index that reads q_idx and not kv_idx, 'kv' for the other way round."""
    free = set().union(*(sp.sympify(i).free_symbols for i in index)) if index else set()
    if S.SCORE in free:
        return None
    if S.Q in free and S.KV not in free:
        return "q"
    if S.KV in free and S.Q not in free:
        return "kv"
    return None


def find_row_dots(expr, captures):
    """``expr`` with every complete sum of products c * a(ia, j) * b(ib, j), j = 0 .. R - 1
    (R >= ROW_DOT_MIN, ia a query's row, ib a key's), replaced by c * RowDot(...)."""
    def rewrite(add):
        groups, rest = {}, []
        for term in add.args:
            coeff, product = term.as_coeff_Mul()  # a number (0.3) and the product it scales
            factors = product.args if product.is_Mul else (product,)
            parsed = [_row_factor(f, captures) for f in factors] if len(factors) == 2 else [None]
            if None in parsed or parsed[0][2] != parsed[1][2]:
                rest.append(term)
                continue
            sides = [_side(p[1]) for p in parsed]
            if sorted(map(str, sides)) != ["kv", "q"]:
                rest.append(term)
                continue
            a, b = parsed if sides[0] == "q" else parsed[::-1]
            groups.setdefault((coeff, a[:2], b[:2]), {})[a[2]] = term
        for (coeff, (na, ia), (nb, ib)), terms in groups.items():
            if len(terms) >= ROW_DOT_MIN and sorted(terms) == list(range(len(terms))):
                rest.append(coeff * RowDot(na, nb, len(terms), sp.Tuple(*ia), sp.Tuple(*ib)))
            else:
                rest.extend(terms.values())
        return sp.Add(*rest)
    return expr.replace(lambda e: isinstance(e, sp.Add), rewrite)
