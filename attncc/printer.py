"""sympy expression -> Triton expression text: the only place expressions become strings.

Names inside generated kernels:
    score               the scaled score tile (float32)
    b, h                batch and query-head index of the program (scalars)
    q_idx, kv_idx       query / key positions: [BLOCK_M, 1] and [1, BLOCK_N] int32 tiles
    q_idx_f, kv_idx_f   the same as float32, for position arithmetic used as a float
    capN_ptr            captured tensor N, with capN_size<d> and capN_stride<d> per dimension

``emit`` runs common-subexpression elimination over a kernel's mod expressions and splits the
resulting assignments into those that vary inside the tile loop and those that do not, so
loop-invariant work (``slopes[h]``, ``doc_ids[q_idx]``) is hoisted out of the loop.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import sympy as sp
from sympy.core.function import AppliedUndef
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.printing.str import StrPrinter

from .passes import symbolic as S
from .passes.rowdots import RowDot, find_row_dots

# The temporaries ``emit`` assigns besides the outputs' labels (which the templates read): cse
# temporaries, hoisted invariants, capture loads, row products, float twins of the positions. None comes from
# the user (a capture's Python name reaches generated files in comments only: plan.comment_name),
# and no template names a variable of this form (tests/test_codegen_names.py), so mod code and
# kernel code never collide.
TEMP_NAMES = re.compile(r"t\d+|inv\d+|cap\d+_\d+|rd\d+|q_idx_f|kv_idx_f")


# Triton functions Gluon does not have: the Gluon templates define these helpers in their place
GLUON_HELPERS = {"tl.sigmoid": "_sigmoid"}
_TL = re.compile(r"\btl\.[A-Za-z_][A-Za-z0-9_]*")


def in_language(text: str, lang: str) -> str:
    """Printed Triton text in another language: ``tl.f`` -> ``{lang}.f`` (or its helper). Safe as a
    text rewrite: printed code holds no user text (captures are cap<n>), only our names."""
    return _TL.sub(lambda m: GLUON_HELPERS.get(m.group(0)) or lang + m.group(0)[2:], text)


class TritonPrinter(StrPrinter):
    """Prints sympy expressions as Triton (triton.language as tl) expressions."""

    def __init__(self, captures: tuple = (), interpreter: bool = False, lang: str = "tl"):
        super().__init__({"full_prec": True})
        self.captures = captures  # (ndim, kind, in_range) per capture number
        # Triton's interpreter turns `scalar_bool & tensor_bool` into int32 (and then rejects it
        # as a load mask): for that target, conjunctions are compared back to bool.
        self.interpreter = interpreter
        # "tl" (triton.language: the Triton tier) or "gl" (triton.experimental.gluon.language: the
        # Gluon tier, whose templates define the helpers it lacks, GLUON_HELPERS)
        self.lang = lang

    def doprint(self, expr):
        """``expr`` as an expression of the printer's language. The methods below write Triton's
        (``tl.``); Gluon has the same functions under ``gl.``, but for GLUON_HELPERS."""
        text = super().doprint(expr)
        return text if self.lang == "tl" else in_language(text, self.lang)

    def as_bool(self, text: str) -> str:
        return f"({text} != 0)" if self.interpreter else text

    def _print(self, expr, **kwargs):
        # a constant subexpression (exp(-3), log(2)/3, ...) becomes one float literal
        if isinstance(expr, sp.Expr) and not expr.is_Atom and expr.is_number and expr.is_finite:
            return repr(float(expr))
        return super()._print(expr, **kwargs)

    def _print_Float(self, e):
        return repr(float(e))

    def _print_Rational(self, e):
        return f"({e.p}.0 / {e.q}.0)"

    def _print_Infinity(self, e):
        return 'float("inf")'

    def _print_NegativeInfinity(self, e):
        return 'float("-inf")'

    def _print_BooleanTrue(self, e):
        return "True"

    def _print_BooleanFalse(self, e):
        return "False"

    def _call(self, fn, *args):
        return f"{fn}({', '.join(self._print(a) for a in args)})"

    def _fcall(self, fn, x):
        """A float-only Triton function: integer arguments are converted first (sympy drops
        int -> float casts, which keep the value)."""
        text = self._print(x)
        return f"{fn}(({text}).to(tl.float32))" if x.is_integer else f"{fn}({text})"

    def _print_Pow(self, e, rational=False):
        base, ex = e.args
        if ex == sp.S.Half:
            return self._fcall("tl.sqrt", base)
        if ex == -sp.S.Half:
            return self._fcall("tl.rsqrt", base)
        if ex.is_number and float(ex).is_integer() and abs(float(ex)) <= 16:
            n = abs(int(float(ex)))
            power = "(" + " * ".join([self.parenthesize(base, 50)] * n) + ")" if n else "1"
            return power if ex > 0 else f"(1.0 / {power})"
        if base == 2:
            return self._fcall("tl.exp2", ex)
        # general power of a positive base (torch gives NaN for a negative one too)
        return f"tl.exp2({self._print(ex)} * {self._fcall('tl.log2', base)})"

    def _print_intdiv(self, e):
        return f"(({self._print(e.args[0])}) / ({self._print(e.args[1])}))"

    def _print_floordiv(self, e):
        # integer a // 0 is 0 (attncc.variant.Variant); the guard is left out where sympy proves
        # the divisor non-zero (a constant, kv_idx + 1)
        return self._call("_floor_div" if e.args[1].is_zero is False else "_floor_div_or_0", *e.args)

    def _print_exp(self, e):
        return self._fcall("tl.exp", e.args[0])

    def _print_exp2(self, e):
        return self._fcall("tl.exp2", e.args[0])

    def _print_log(self, e):
        return self._fcall("tl.log", e.args[0])

    def _print_log2(self, e):
        return self._fcall("tl.log2", e.args[0])

    def _print_tanh(self, e):
        return self._fcall("_tanh", e.args[0])

    def _print_sigmoid(self, e):
        return self._fcall("tl.sigmoid", e.args[0])

    def _print_Abs(self, e):
        return self._call("tl.abs", e.args[0])

    def _print_trunc(self, e):
        return f"({self._print(e.args[0])}).to(tl.int32)"

    def _print_floor(self, e):
        return self._fcall("tl.floor", e.args[0])

    def _print_Mod(self, e):
        a, m = e.args
        if a.is_integer and m.is_integer:  # a % 0 is a, guarded as in _print_floordiv
            return self._call("_floor_mod" if m.is_zero is False else "_floor_mod_or_a", a, m)
        return f"({self._print(a)} - {self.parenthesize(m, 50)} * tl.floor({self._print(a)} / {self.parenthesize(m, 50)}))"

    def _minmax(self, fn, args):
        out = self._print(args[0])
        for a in args[1:]:
            out = f"{fn}({out}, {self._print(a)})"
        return out

    def _print_Min(self, e):
        return self._minmax("tl.minimum", e.args)

    def _print_Max(self, e):
        return self._minmax("tl.maximum", e.args)

    def _print_Piecewise(self, e):
        *branches, (last, cond) = e.args
        out = self._print(last)
        if cond != sp.true:
            out = f"tl.where({self._print(cond)}, {out}, 0)"
        for value, c in reversed(branches):
            out = f"tl.where({self._print(c)}, {self._print(value)}, {out})"
        return out

    def _print_Relational(self, e):
        op = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}[e.rel_op]
        return f"({self._print(e.lhs)} {op} {self._print(e.rhs)})"

    def _logic(self, op, args):
        return "(" + f" {op} ".join(self._print(a) for a in args) + ")"

    def _print_And(self, e):
        return self.as_bool(self._logic("&", e.args))

    def _print_Or(self, e):
        return self.as_bool(self._logic("|", e.args))

    def _print_Xor(self, e):
        return self.as_bool(self._logic("^", e.args))

    def _print_bit_and(self, e):
        return self._logic("&", e.args)

    def _print_bit_or(self, e):
        return self._logic("|", e.args)

    def _print_bit_xor(self, e):
        return self._logic("^", e.args)

    def _print_Not(self, e):
        return f"({self._print(e.args[0])} == 0)"

    def _print_Heaviside(self, e):
        x = self._print(e.args[0])
        return f"tl.where({x} > 0, 1.0, tl.where({x} < 0, 0.0, 0.5))"

    def _print_sign(self, e):
        x = self._print(e.args[0])
        if e.args[0].is_integer:
            return f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0))"
        return f"tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, 0.0))"

    # Math functions of FlexAttention mods (attncc.ir.UNARY_MATH). Where Triton has no function of
    # its own, CUDA targets call libdevice (imported by templates/header.py.jinja on GPUs only) and
    # the interpreter, which has no libdevice, gets an equivalent expression.

    def _print_sin(self, e):
        return self._fcall("tl.sin", e.args[0])

    def _print_cos(self, e):
        return self._fcall("tl.cos", e.args[0])

    def _print_tan(self, e):
        return f"({self._fcall('tl.sin', e.args[0])} / {self._fcall('tl.cos', e.args[0])})"

    def _print_erf(self, e):
        return self._fcall("tl.erf", e.args[0])

    def _print_ceiling(self, e):
        return self._fcall("tl.ceil", e.args[0])

    def _print_atan(self, e):
        # the interpreter's _atan is templates/header.py.jinja's (Cephes' atanf, error ~1e-7)
        return self._fcall("libdevice.atan" if not self.interpreter else "_atan", e.args[0])

    def _print_log1p(self, e):
        if not self.interpreter:
            return self._fcall("libdevice.log1p", e.args[0])
        # Goldberg's log1p: log(u) * x / (u - 1) with u = 1 + x rounded, within a few ulps
        x = self._fcall("", e.args[0])
        u = f"(1.0 + {x})"
        return f'tl.where({u} == 1.0, {x}, tl.where({u} == float("inf"), {u}, tl.log({u}) * {x} / ({u} - 1.0)))'

    def _print_expm1(self, e):
        if not self.interpreter:
            return self._fcall("libdevice.expm1", e.args[0])
        # Kahan's expm1: (u - 1) * x / log(u) with u = exp(x) rounded
        x = self._fcall("", e.args[0])
        u = self._fcall("tl.exp", e.args[0])
        return (f'tl.where({u} == 1.0, {x}, tl.where(({u} == float("inf")) | ({u} - 1.0 == -1.0), {u} - 1.0, '
                f"({u} - 1.0) * {x} / tl.log({u})))")

    def _print_rint(self, e):
        if not self.interpreter:
            return self._fcall("libdevice.rint", e.args[0])
        # ties to even: floor(x + 0.5), one less where x was a tie below an odd r; from 2**23 on
        # every float32 is an integer (and x + 0.5 would round)
        x = self._fcall("", e.args[0])
        r = f"tl.floor({x} + 0.5)"
        tie_to_odd = f"({r} - {x} == 0.5) & ({r} % 2.0 != 0.0)"
        return f"tl.where(tl.abs({x}) >= 8388608.0, {x}, tl.where({tie_to_odd}, {r} - 1.0, {r}))"

    def _print_fmod(self, e):
        a, b = e.args
        if a.is_integer and b.is_integer:  # C's %, which Triton's % on integers is; a fmod 0 is a
            at, bt = self._print(a), self._print(b)
            if b.is_zero is False:
                return f"(({at}) % ({bt}))"
            return f"tl.where({bt} == 0, {at}, ({at}) % tl.where({bt} == 0, 1, {bt}))"
        as_float = lambda x: repr(float(x)) if x.is_Number else self._fcall("", x)  # noqa: E731
        return f"({as_float(a)} % {as_float(b)})"  # Triton's % on floats is C's fmod (frem)

    def _print_lshift(self, e):
        return f"({self._print(e.args[0])} << {self._print(e.args[1])})"

    def _print_rshift(self, e):
        return f"({self._print(e.args[0])} >> {self._print(e.args[1])})"

    def _print_bit_not(self, e):
        return f"(~{self._print(e.args[0])})"

    def _print_Function(self, e):
        if isinstance(e, AppliedUndef) and e.func.__name__.startswith("cap"):
            return self._load(int(e.func.__name__[3:]), e.args)
        return super()._print_Function(e)

    def _print_RowDot(self, e):
        (na, ia), (nb, ib) = (e.side(0), e.side(1))
        args = [self._row(na, ia), self._row(nb, ib)]
        pad = max(16, 1 << (e.length - 1).bit_length())
        return f"_row_dot({', '.join(args)}, {e.length}, {pad})"

    def _row(self, n, index) -> str:
        """`ptr, offset, mask, step` of rows of captured tensor n: the leading indices ``index``,
        the last dimension stepped through by _row_dot (templates/header.py.jinja)."""
        offset, bounds = self._address(n, index, f"cap{n}_stride")
        mask = "None" if self.in_range(n) else self.as_bool(bounds)
        return f"cap{n}_ptr, {offset}, {mask}, cap{n}_stride{len(index)}"

    def in_range(self, n: int) -> bool:
        """Whether every index of captured tensor ``n`` stays inside it (checked on the host):
        its loads need no bounds mask."""
        return self.captures[n][2]

    def address(self, n, index, strides: str) -> tuple[str, str]:
        """(element offset, in-bounds condition) of captured tensor n at ``index``, in the
        printer's language: the offset over the strides named ``strides``0, 1, ... (the tensor's
        own, or its gradient's), the condition over the tensor's sizes."""
        offset, bounds = self._address(n, index, strides)
        return tuple(text if self.lang == "tl" else in_language(text, self.lang) for text in (offset, bounds))

    def _address(self, n, index, strides) -> tuple[str, str]:
        offsets, bounds = [], []
        for d, i in enumerate(index):
            text = self._print(i)
            offsets.append(f"{text} * {strides}{d}" if i.is_Integer else f"({text}).to(tl.int64) * {strides}{d}")
            bounds.append(f"({text} >= 0) & ({text} < cap{n}_size{d})")
        return " + ".join(offsets), " & ".join(bounds)

    def _load(self, n, index):
        ndim, kind, in_range = self.captures[n]
        convert = ".to(tl.float32)" if kind == "float" else ".to(tl.int32)"
        if not index:
            return f"tl.load(cap{n}_ptr){convert}"
        offset, bounds = self._address(n, index, f"cap{n}_stride")
        if in_range:
            return f"tl.load(cap{n}_ptr + {offset}){convert}"
        return f"tl.load(cap{n}_ptr + {offset}, mask={self.as_bool(bounds)}, other=0){convert}"


@dataclass(frozen=True)
class ModCode:
    """Triton statements for a kernel's mods: ``hoisted`` runs once per program before the
    tile loop, ``body`` inside it, ``late`` after the body where a kernel defines the ``late``
    symbols emit was given; ``outputs`` are the labels the statements assign."""
    hoisted: tuple  # ((name, text), ...)
    body: tuple
    outputs: tuple
    late: tuple = ()

    def has(self, label: str) -> bool:
        return label in self.outputs


def typed_symbol(name: str, expr) -> sp.Symbol:
    """A symbol standing for ``expr`` in generated code, with expr's kind (bool, int or real)."""
    if isinstance(expr, sp.logic.boolalg.Boolean) and not isinstance(expr, sp.Expr):
        return BoolSymbol(name)
    return sp.Symbol(name, integer=True) if expr.is_integer else sp.Symbol(name, real=True)


class BoolSymbol(sp.Symbol):
    """A named boolean temporary: sympy logic (Piecewise conditions, And) accepts it."""
    is_Boolean = True

    def as_set(self):  # pragma: no cover - never asked for by the printer
        raise NotImplementedError


# Float twins of the position tiles. Integer position arithmetic that feeds float math (ALiBi's
# slope * (kv_idx - q_idx)) is rewritten over them, so each score pays one float op instead of an
# integer op plus an int -> float conversion, which Hopper issues at a quarter of the float rate
# (as slow as the exp2). Exact while the positions and their sums stay below 2**24.
QF, KVF = sp.symbols("q_idx_f kv_idx_f", real=True)
_TWINS = {S.Q: QF, S.KV: KVF}


def float_positions(expr):
    """``expr``, a mod output the kernels use as a float, with its integer subexpressions built
    from positions by +, -, integer multiples, abs, min and max rewritten over the float twins."""
    return expr.xreplace(_TWINS) if _position_sum(expr) else _float_args(expr)


def _float_args(expr):
    if expr.is_Atom or isinstance(expr, AppliedUndef) or expr.is_integer:
        return expr  # a capture's index, a floor division, a comparison: integer context
    if isinstance(expr, sp.Piecewise):
        return sp.Piecewise(*[(float_positions(e), c) for e, c in expr.args])
    if isinstance(expr, sp.Pow):
        return sp.Pow(float_positions(expr.base), expr.exp)
    if isinstance(expr, (sp.Add, sp.Mul, sp.Function, sp.Min, sp.Max)) and not isinstance(expr, sp.logic.boolalg.Boolean):
        return expr.func(*[float_positions(a) for a in expr.args])
    return expr


def _position_sum(e) -> bool:
    """An integer expression over q_idx / kv_idx that float32 computes exactly (small values)."""
    if not (e.is_integer and e.free_symbols & set(_TWINS)):
        return False
    for node in sp.preorder_traversal(e):
        if isinstance(node, sp.Mul):
            if sum(1 for a in node.args if not a.is_Integer) > 1:
                return False  # q_idx * kv_idx can pass 2**24
        elif not (node.is_Integer or node.is_Symbol or isinstance(node, (sp.Add, sp.Abs, sp.Min, sp.Max))):
            return False
    return True


def emit(outputs: list, captures: tuple, loop_symbols: set, interpreter: bool = False, lang: str = "tl",
         row_dots: bool = False, late: tuple = ()) -> ModCode:
    """Statements computing the labelled expressions ``outputs`` [(label, sympy expr), ...].

    Common subexpressions become temporaries ``t<k>``; each captured-tensor load gets a
    temporary ``cap<n>_<k>``; maximal subexpressions that do not read ``loop_symbols`` (kv_idx
    in the forward) or the score are hoisted before the tile loop (``inv<k>``). With
    ``row_dots``, dot products of a row per query and a row per key become one tile product
    each (``rd<k>``, attncc.passes.rowdots). Statements that read a symbol of ``late`` (which the
    kernel defines after the body) go to ``late``."""
    printer = TritonPrinter(captures, interpreter, lang)
    labels = [label for label, _ in outputs]
    outputs = [e for _, e in outputs]
    if row_dots:
        outputs = [find_row_dots(e, captures) for e in outputs]
    temps, reduced = sp.cse(outputs, symbols=sp.numbered_symbols("t"), order="none") if outputs else ([], [])
    # cse's temporaries know nothing of their values; give each the type of what it stands for,
    # so the printer still knows integer from float through them (floor division, casts).
    typed = {}
    for i, (sym, expr) in enumerate(temps):
        expr = expr.xreplace(typed)
        typed[sym] = typed_symbol(str(sym), expr)
        temps[i] = (typed[sym], expr)
    reduced = [r.xreplace(typed) for r in reduced]
    varying = set(loop_symbols) | {S.SCORE} | set(late) | {_TWINS[s] for s in loop_symbols if s in _TWINS}
    late = set(late)
    hoisted, body, after = [], [], []
    for pos, twin in _TWINS.items():
        if any(twin in e.free_symbols for e in outputs):
            (body if pos in loop_symbols else hoisted).append((str(twin), f"{pos}.to({printer.lang}.float32)"))
    counts = {}

    def name(prefix, expr, invariant):
        counts[prefix] = counts.get(prefix, -1) + 1
        sym = typed_symbol(f"{prefix}{counts[prefix]}", expr)
        is_late = bool(expr.free_symbols & late)
        (after if is_late else hoisted if invariant else body).append((str(sym), printer.doprint(expr)))
        if not invariant:
            varying.add(sym)
        if is_late:
            late.add(sym)
        return sym

    def lift(e, parent_invariant):
        if e.is_Atom:
            return e
        invariant = not (e.free_symbols & varying)
        args = [lift(a, invariant) for a in e.args]
        if any(x is not y for x, y in zip(args, e.args)):
            e = e.func(*args)
        if isinstance(e, AppliedUndef) and e.func.__name__.startswith("cap"):
            return name(f"{e.func.__name__}_", e, invariant)  # never the user's name (see TEMP_NAMES)
        if isinstance(e, RowDot):
            return name("rd", e, invariant)
        if invariant and not parent_invariant and sp.count_ops(e) > 1 and not isinstance(e, (ExprCondPair, sp.Tuple)):
            return name("inv", e, True)
        return e

    for sym, expr in list(temps) + list(zip(labels, reduced)):
        invariant = not (expr.free_symbols & varying)
        is_late = bool(expr.free_symbols & late)
        expr = lift(expr, invariant)
        (after if is_late else hoisted if invariant else body).append((str(sym), printer.doprint(expr)))
        if not invariant and isinstance(sym, sp.Symbol):
            varying.add(sym)
            if is_late:
                late.add(sym)
    return ModCode(tuple(hoisted), tuple(body), tuple(labels), tuple(after))

