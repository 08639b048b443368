"""IR -> sympy: simplification and canonical form of score and mask expressions.

SymPy's automatic canonicalisation (constant folding, sorted sums and products, x*1 -> x,
Max(x, -oo) -> x, ...) is the simplifier; ``srepr`` of the result is the canonical hash, so
``score + bias`` and ``bias + score`` share one kernel. Value semantics follow torch: ``//``
and ``%`` floor (sympy's floor and Mod do too), ``.long()`` truncates toward zero; on integers
``x // 0 == 0`` and ``x % 0 == x`` (``Mod``), where torch raises.

Leaves become symbols (score real, indices non-negative integers); a captured tensor becomes
an undefined function ``capN(index...)``; operations sympy lacks (exp2, log2, sigmoid, trunc,
log1p, expm1, rint, fmod, shifts, bitwise) are small Function classes that know their derivative.
"""
from __future__ import annotations

import math

import sympy as sp

from .. import ir
from ..errors import AttnccError

SCORE = sp.Symbol("score", real=True)
B, H, Q, KV = sp.symbols("b h q_idx kv_idx", integer=True, nonnegative=True)
LEAF_SYMBOLS = {"score": SCORE, "b": B, "h": H, "q_idx": Q, "kv_idx": KV}
LN2 = sp.log(2)


class exp2(sp.Function):
    """2**x, kept whole so it prints as tl.exp2."""
    def fdiff(self, argindex=1):
        return LN2 * exp2(self.args[0])


class log2(sp.Function):
    def fdiff(self, argindex=1):
        return 1 / (LN2 * self.args[0])


class sigmoid(sp.Function):
    def fdiff(self, argindex=1):
        return sigmoid(self.args[0]) * (1 - sigmoid(self.args[0]))

    @classmethod
    def eval(cls, x):
        if x.is_Number and x.is_finite:
            return 1 / (1 + sp.exp(-x))


class trunc(sp.Function):
    """Round toward zero, the semantics of .long() on a float."""
    is_integer = True


class floordiv(sp.Function):
    """Integer a // b rounding toward -inf, kept whole: sympy's floor(a/b) would be split into
    float terms (floor(kv/3 - q/3)) that round differently in float32."""
    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer and b != 0:
            return sp.Integer(int(a) // int(b))


class Mod(sp.Mod):
    """a % b with the sign of the divisor (torch.remainder), differentiable; on integers a divisor
    that may be 0. attncc defines a % 0 = a and a // 0 = 0 (see
    attncc.variant.Variant), so unlike sympy's Mod (undefined at 0) it is an integer for every
    divisor, and the printer keeps it in integer arithmetic. sympy's rewrites of Mod (Mod(x + q,
    q) = Mod(x, q), Mod(k*x, k*q) = k*Mod(x, q), ...) hold at q = 0 under that definition too.
    It keeps the name Mod: printers pick their method by class name (TritonPrinter._print_Mod)."""

    def _eval_is_integer(self):
        a, b = self.args
        return True if a.is_integer and b.is_integer else None

    def fdiff(self, argindex=1):
        """a % b = a - b * floor(a / b): 1 in a and -floor(a / b) in b (torch's remainder
        gradients); sympy's own Mod has no derivative."""
        a, b = self.args
        return sp.S.One if argindex == 1 else -sp.floor(a / b)


class intdiv(sp.Function):
    """True division of two integers, kept whole so (q - kv) / 3 is not distributed into
    q/3 - kv/3 (exact multiples must stay exact before a trunc or floor)."""
    is_real = True

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer and b != 0:
            return sp.Rational(a, b)


class log1p(sp.Function):
    """log(1 + x), kept whole: accurate for small x (the kernels print an accurate form)."""
    def fdiff(self, argindex=1):
        return 1 / (1 + self.args[0])

    @classmethod
    def eval(cls, x):
        if x.is_zero:
            return sp.S.Zero


class expm1(sp.Function):
    """exp(x) - 1, kept whole: accurate for small x."""
    def fdiff(self, argindex=1):
        return sp.exp(self.args[0])

    @classmethod
    def eval(cls, x):
        if x.is_zero:
            return sp.S.Zero


class rint(sp.Function):
    """torch.round: to the nearest integer, ties to even. Piecewise constant: like floor, it has no
    fdiff, so the facts do not take score + rint(score) for an additive bias; attncc.passes.derive
    gives it derivative 0, as torch does."""
    is_integer = True

    @classmethod
    def eval(cls, x):
        if x.is_integer:
            return x
        if x.is_Number and x.is_finite:
            return sp.Integer(round(float(x)))  # Python's round: ties to even


class fmod(sp.Function):
    """torch.fmod: a - b * trunc(a / b), the sign of the dividend (C's fmod). On integers
    a fmod 0 = a (attncc's rule for a remainder by 0, as for %)."""

    def fdiff(self, argindex=1):
        a, b = self.args
        return sp.S.One if argindex == 1 else -trunc(a / b)

    def _eval_is_integer(self):
        a, b = self.args
        return True if a.is_integer and b.is_integer else None

    def _eval_is_real(self):
        return True if all(x.is_real for x in self.args) else None

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return a if b == 0 else sp.Integer(int(math.fmod(int(a), int(b))))


class _Shift(sp.Function):
    is_integer = True


class lshift(_Shift):
    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer and 0 <= b < 64:
            return sp.Integer(int(a) << int(b))


class rshift(_Shift):
    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer and 0 <= b < 64:
            return sp.Integer(int(a) >> int(b))


class _Bitwise(sp.Function):
    is_integer = True


class bit_and(_Bitwise): pass
class bit_or(_Bitwise): pass
class bit_xor(_Bitwise): pass
class bit_not(_Bitwise): pass


def capture_function(index: int, kind: str):
    """The sympy function standing for captured tensor number ``index``."""
    if kind == ir.FLOAT:
        return sp.Function(f"cap{index}", real=True)
    return sp.Function(f"cap{index}", integer=True)


_UNARY = {
    "neg": lambda a: -a, "abs": sp.Abs, "floor": sp.floor, "exp": sp.exp, "exp2": exp2,
    "log": sp.log, "log2": log2, "tanh": sp.tanh, "sigmoid": sigmoid, "sqrt": sp.sqrt,
    "rsqrt": lambda a: 1 / sp.sqrt(a),
    "sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "atan": sp.atan, "erf": sp.erf, "log1p": log1p,
    "expm1": expm1, "sign": sp.sign, "round": rint, "ceil": sp.ceiling, "trunc": trunc,
}
_BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "truediv": lambda a, b: a / b, "floordiv": lambda a, b: sp.floor(a / b), "mod": Mod,
    "pow": lambda a, b: a ** b, "minimum": sp.Min, "maximum": sp.Max,
    "lt": sp.Lt, "le": sp.Le, "gt": sp.Gt, "ge": sp.Ge, "eq": sp.Eq, "ne": sp.Ne,
    "fmod": fmod, "lshift": lshift, "rshift": rshift,
}
_LOGIC = {"and": (sp.And, bit_and), "or": (sp.Or, bit_or), "xor": (sp.Xor, bit_xor)}


def to_sympy(root: ir.Node, capture_index: dict) -> sp.Basic:
    """The sympy form of an IR expression; ``capture_index`` maps each Capture to its number."""
    memo = {}
    for n in ir.walk(root):  # children first
        a = [memo[x] for x in n.args]
        # the arguments as numbers: a bool used in arithmetic counts 1 or 0
        num = [sp.Piecewise((1, e), (0, True)) if x.type == ir.BOOL else e for x, e in zip(n.args, a)]
        if n.op in LEAF_SYMBOLS:
            e = LEAF_SYMBOLS[n.op]
        elif n.op == "const":
            v = n.value
            if isinstance(v, bool):
                e = sp.true if v else sp.false
            elif isinstance(v, int):
                e = sp.Integer(v)
            elif v in (float("inf"), float("-inf")):
                e = sp.oo if v > 0 else -sp.oo
            else:
                e = sp.Float(v, precision=53)
        elif n.op == "load":
            f = capture_function(capture_index[n.value], n.value.kind)(*a)
            e = sp.Ne(f, 0) if n.type == ir.BOOL else f
        elif n.op in _LOGIC:
            logical, bitwise = _LOGIC[n.op]
            e = logical(*a) if n.type == ir.BOOL else bitwise(*num)
        elif n.op == "invert":
            e = sp.Not(a[0]) if n.type == ir.BOOL else bit_not(num[0])
        elif n.op == "where":
            if n.type == ir.BOOL:
                e = sp.Or(sp.And(a[0], a[1]), sp.And(sp.Not(a[0]), a[2]))
            else:
                e = sp.Piecewise((num[1], a[0]), (num[2], True))
        elif n.op == "cast":
            src = n.args[0].type
            if n.value == ir.BOOL:
                e = sp.Ne(a[0], 0)
            elif src == ir.BOOL:
                e = num[0]
            elif n.value == ir.INT and src == ir.FLOAT:
                e = trunc(a[0])
            else:
                e = a[0]  # int -> float keeps the value
        elif n.op in _UNARY:
            e = _UNARY[n.op](num[0])
        elif n.op in ("eq", "ne") and n.args[0].type == n.args[1].type == ir.BOOL:
            e = sp.Not(sp.Xor(*a)) if n.op == "eq" else sp.Xor(*a)
        elif n.op == "floordiv" and n.type == ir.INT:
            e = floordiv(*num)
        elif n.op == "mod" and n.type == ir.INT and num[1].is_zero is not False:
            e = Mod(*num)
        elif n.op == "truediv" and n.args[0].type != ir.FLOAT and n.args[1].type != ir.FLOAT:
            e = intdiv(*num)
        elif n.op in _BINARY:
            e = _BINARY[n.op](*num)
        else:  # pragma: no cover - the IR constructors admit no other op
            raise AttnccError(f"internal: no sympy rule for IR op {n.op!r}")
        memo[n] = e
    return memo[root]


def canonicalize(expr: sp.Basic) -> sp.Basic:
    """One spelling per comparison: kv_idx <= q_idx becomes q_idx >= kv_idx."""
    def one(rel):
        c = rel.canonical  # sympy's order puts the smaller side left: kv_idx <= q_idx
        if isinstance(c, (sp.LessThan, sp.StrictLessThan)):  # read as written most often: q_idx >= kv_idx
            return (sp.Ge if isinstance(c, sp.LessThan) else sp.Gt)(c.rhs, c.lhs)
        return c
    return expr.replace(lambda e: e.is_Relational, one)


def canonical(expr: sp.Basic) -> str:
    """A stable text of a sympy expression, equal for mathematically identical canonical forms."""
    return sp.srepr(expr)
