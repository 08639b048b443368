"""The attncc IR: small immutable expression nodes for score and mask modifiers.

A score_mod is an expression over the leaves ``score, b, h, q_idx, kv_idx``; a mask_mod the
same without ``score``. Every node carries one of three value types:

    float   computed in float32 in the kernels (float64 in the reference)
    int     computed in int32 in the kernels (int64 in the reference)
    bool    predicates

Nodes are built through the constructors below, which infer and check types, so an ill-typed
expression fails where it is written. Tracing a Python mod (``attncc.trace``) produces exactly
these nodes, so a variant can also be written directly::

    from attncc import ir
    alibi = ir.score + ir.load(slopes, ir.h) * (ir.kv_idx - ir.q_idx)
    causal = ir.q_idx >= ir.kv_idx

A tensor that a mod reads becomes a ``Capture``: a kernel argument (pointer, sizes, strides),
compared by identity, never baked into the kernel. ``canonical_key`` names captures by their
order of appearance, so two variants that differ only in which tensor they read share kernels.
"""
from __future__ import annotations

import math
import torch

from .errors import AttnccError

FLOAT, INT, BOOL = "float", "int", "bool"

# op name -> (number of arguments, type rule); the one table of what the IR can express.
#   "float":   result is float (int/bool operands are promoted)
#   "promote": result is float if any operand is float, else int (bool counts as int)
#   "same":    result has the operand's type (float or int)
#   "bool":    comparison, result is bool
#   "logic":   bool x bool -> bool (logical), int x int -> int (bitwise)
UNARY = {
    "neg": "same", "abs": "same", "floor": "same", "invert": "logic",
    "exp": "float", "exp2": "float", "log": "float", "log2": "float", "tanh": "float",
    "sigmoid": "float", "sqrt": "float", "rsqrt": "float",
}
BINARY = {
    "add": "promote", "sub": "promote", "mul": "promote", "truediv": "float",
    "floordiv": "promote", "mod": "promote", "pow": "promote",
    "minimum": "promote", "maximum": "promote",
    "lt": "bool", "le": "bool", "gt": "bool", "ge": "bool", "eq": "bool", "ne": "bool",
    "and": "logic", "or": "logic", "xor": "logic",
}
# The math and rounding functions and integer shifts FlexAttention mods use besides the core ops
# above (same rules). Kept in tables of their own: tests/test_trace.py's table of traced cases
# covers UNARY and BINARY, tests/test_flex_compat.py covers these.
UNARY_MATH = {
    "sin": "float", "cos": "float", "tan": "float", "atan": "float", "erf": "float",
    "log1p": "float", "expm1": "float",
    "sign": "same", "round": "same", "ceil": "same", "trunc": "same",  # round: half to even, as torch
}
BINARY_MATH = {
    "fmod": "promote",                    # remainder with the sign of the dividend (C's fmod)
    "lshift": "shift", "rshift": "shift",  # integer << and >> (arithmetic)
}
# on integers these are the identity: no node is made
INT_IDENTITY = {"round", "ceil", "trunc"}
LEAVES = ("score", "b", "h", "q_idx", "kv_idx")
# dtypes a captured tensor may have: Triton loads them on every target, the interpreter included
# (float8 fails in the interpreter and before sm89; uint32/64 do not fit the int32 index math)
CAPTURE_DTYPES = (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
                  torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Capture:
    """A tensor read by a mod. Equal only to a Capture of the very same tensor object."""

    __slots__ = ("tensor", "name")

    def __init__(self, tensor: torch.Tensor, name: str | None = None):
        self.tensor = tensor
        self.name = name

    @property
    def ndim(self) -> int:
        """Number of dimensions: how many indices a load of this tensor takes."""
        return self.tensor.dim()

    @property
    def kind(self) -> str:
        """The IR type of a read element: 'bool', 'int' or 'float' (computed in float32)."""
        if self.tensor.dtype == torch.bool:
            return BOOL
        return FLOAT if self.tensor.is_floating_point() else INT

    def __eq__(self, other):
        return isinstance(other, Capture) and other.tensor is self.tensor

    def __hash__(self):
        return id(self.tensor)

    def __repr__(self):
        shape = "x".join(map(str, self.tensor.shape)) or "scalar"
        return f"{self.name or 'tensor'}[{shape} {str(self.tensor.dtype).removeprefix('torch.')}]"


class Node:
    """One immutable IR node: ``op`` applied to ``args``; ``value`` holds a constant, a cast
    target or a Capture; ``type`` is float, int or bool."""

    __slots__ = ("op", "args", "value", "type", "_hash")

    def __init__(self, op: str, args: tuple = (), value=None, type: str = FLOAT):
        self.op, self.args, self.value, self.type = op, tuple(args), value, type
        self._hash = hash((op, self.args, value, type))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (
            isinstance(other, Node) and self._hash == other._hash and self.op == other.op
            and self.type == other.type and self.value == other.value and self.args == other.args)

    def __repr__(self):
        return to_text(self)

    # Operator overloading so IR can be written as ordinary expressions.
    def __add__(self, o): return binary("add", self, o)
    def __radd__(self, o): return binary("add", o, self)
    def __sub__(self, o): return binary("sub", self, o)
    def __rsub__(self, o): return binary("sub", o, self)
    def __mul__(self, o): return binary("mul", self, o)
    def __rmul__(self, o): return binary("mul", o, self)
    def __truediv__(self, o): return binary("truediv", self, o)
    def __rtruediv__(self, o): return binary("truediv", o, self)
    def __floordiv__(self, o): return binary("floordiv", self, o)
    def __rfloordiv__(self, o): return binary("floordiv", o, self)
    def __mod__(self, o): return binary("mod", self, o)
    def __rmod__(self, o): return binary("mod", o, self)
    def __pow__(self, o): return binary("pow", self, o)
    def __rpow__(self, o): return binary("pow", o, self)
    def __lt__(self, o): return binary("lt", self, o)
    def __le__(self, o): return binary("le", self, o)
    def __gt__(self, o): return binary("gt", self, o)
    def __ge__(self, o): return binary("ge", self, o)
    def __and__(self, o): return binary("and", self, o)
    def __rand__(self, o): return binary("and", o, self)
    def __or__(self, o): return binary("or", self, o)
    def __ror__(self, o): return binary("or", o, self)
    def __xor__(self, o): return binary("xor", self, o)
    def __rxor__(self, o): return binary("xor", o, self)
    def __lshift__(self, o): return binary("lshift", self, o)
    def __rlshift__(self, o): return binary("lshift", o, self)
    def __rshift__(self, o): return binary("rshift", self, o)
    def __rrshift__(self, o): return binary("rshift", o, self)
    def __neg__(self): return unary("neg", self)
    def __invert__(self): return unary("invert", self)
    def __abs__(self): return unary("abs", self)
    # == and != stay structural (nodes are dict keys); use ir.eq / ir.ne to build comparisons.


def const(value) -> Node:
    """A compile-time constant: Python bool, int or float (including +-inf)."""
    if isinstance(value, Node):
        return value
    if isinstance(value, bool):
        return Node("const", (), value, BOOL)
    if isinstance(value, int):
        if not -2**31 <= value < 2**31:
            raise AttnccError(f"integer constant {value} does not fit in int32, the kernels' index type")
        return Node("const", (), value, INT)
    if isinstance(value, float):
        if math.isnan(value):
            raise AttnccError("a NaN constant in a mod is not supported")
        return Node("const", (), float(value), FLOAT)
    raise AttnccError(f"cannot use a value of type {type(value).__name__} in an attention mod; "
                      "use Python numbers, traced values or indexed captured tensors")


def _rank(t: str) -> int:
    return {BOOL: 0, INT: 1, FLOAT: 2}[t]


def _result_type(op: str, rule: str, types: list[str]) -> str:
    if rule == "float":
        return FLOAT
    if rule == "bool":
        return BOOL
    if rule == "same":
        if types[0] == BOOL:
            raise AttnccError(f"'{op}' is not defined on bool values; convert with .to(torch.int32) first")
        return types[0]
    if rule == "logic":
        if all(t == BOOL for t in types):
            return BOOL
        if all(t in (INT, BOOL) for t in types):
            return INT
        raise AttnccError(f"'{op}' (&, |, ^, ~) needs bool or int operands, got {' and '.join(types)}")
    if rule == "shift":
        if all(t in (INT, BOOL) for t in types):
            return INT
        raise AttnccError(f"'{op}' (<<, >>) needs integer operands, got {' and '.join(types)}; shift integers "
                          "(q_idx, kv_idx, .long() values), or multiply a float by a power of two")
    top = max(types, key=_rank)
    return FLOAT if top == FLOAT else INT


def unary(op: str, x) -> Node:
    """IR node for the unary operation ``op`` (a key of ``UNARY`` or ``UNARY_MATH``) of ``x``,
    type-checked."""
    x = const(x)
    t = _result_type(op, UNARY[op] if op in UNARY else UNARY_MATH[op], [x.type])
    if op in INT_IDENTITY and t == INT:
        return x
    return Node(op, (x,), None, t)


def binary(op: str, x, y) -> Node:
    """IR node for the binary operation ``op`` (a key of ``BINARY`` or ``BINARY_MATH``) of ``x``
    and ``y``; Python numbers become constants, int operands of a float operation are promoted."""
    x, y = const(x), const(y)
    if op in ("truediv", "floordiv", "mod", "fmod") and y.op == "const" and y.value == 0:
        raise AttnccError(f"{to_text(x)} {_SYMBOLS.get(op, op)} 0 divides by zero; a mod must divide by a non-zero "
                          "number (torch.where can select another value where a divisor is 0)")
    return Node(op, (x, y), None, _result_type(op, BINARY[op] if op in BINARY else BINARY_MATH[op], [x.type, y.type]))


def where(cond, x, y) -> Node:
    """``torch.where(cond, x, y)``: ``cond`` must be bool; the result is float if either branch is."""
    cond, x, y = const(cond), const(x), const(y)
    if cond.type != BOOL:
        raise AttnccError(f"the condition of where() must be bool, got {cond.type}")
    if x.type == y.type:
        t = x.type
    else:
        t = FLOAT if FLOAT in (x.type, y.type) else INT
    return Node("where", (cond, x, y), None, t)


def cast(x, to: str) -> Node:
    """``x`` converted to 'float', 'int' (truncating toward zero, like .long()) or 'bool' (x != 0)."""
    x = const(x)
    if to not in (FLOAT, INT, BOOL):
        raise AttnccError(f"unknown cast target {to!r}")
    return x if x.type == to else Node("cast", (x,), to, to)


def load(tensor, *index) -> Node:
    """Read ``tensor[index...]``: one traced integer expression per dimension (none for a 0-d
    tensor, which is a runtime scalar). Out-of-range reads give 0 (False for bool tensors)."""
    cap = tensor if isinstance(tensor, Capture) else Capture(tensor)
    if not isinstance(cap.tensor, torch.Tensor):
        raise AttnccError(f"load() needs a torch.Tensor, got {type(cap.tensor).__name__}")
    idx = tuple(const(i) for i in index)
    if len(idx) != cap.ndim:
        raise AttnccError(f"captured tensor of shape {tuple(cap.tensor.shape)} indexed with {len(idx)} "
                          f"indices; index every dimension with one integer expression")
    for i in idx:
        if i.type != INT:
            raise AttnccError(f"a captured tensor index must be an integer expression, got {i.type} "
                              f"({to_text(i)}); use .long() or // to make it integral")
    if cap.tensor.dtype not in CAPTURE_DTYPES:
        raise AttnccError(
            f"captured tensor of shape {tuple(cap.tensor.shape)} has dtype {cap.tensor.dtype}, which the kernels "
            "cannot read; supported: bool, int8/16/32/64, uint8/16, float16, bfloat16, float32, float64. "
            "Convert it first, e.g. .to(torch.float32) or .to(torch.int32)")
    return Node("load", idx, cap, cap.kind)


# The leaves: the (scaled) score, batch index, query-head index, query and key positions.
score = Node("score", type=FLOAT)
b = Node("b", type=INT)
h = Node("h", type=INT)
q_idx = Node("q_idx", type=INT)
kv_idx = Node("kv_idx", type=INT)


def _make_unary(op):
    def f(x):
        return unary(op, x)
    f.__name__ = op
    f.__doc__ = f"IR node for {op}(x)."
    return f


def _make_binary(op):
    def f(x, y):
        return binary(op, x, y)
    f.__name__ = op
    f.__doc__ = f"IR node for {op}(x, y)."
    return f


exp, exp2, log, log2, tanh, sigmoid, sqrt, rsqrt, floor = (
    _make_unary(o) for o in ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "floor"))
minimum, maximum, eq, ne = (_make_binary(o) for o in ("minimum", "maximum", "eq", "ne"))
sin, cos, tan, atan, erf, log1p, expm1, sign, round, ceil, trunc = (
    _make_unary(o) for o in ("sin", "cos", "tan", "atan", "erf", "log1p", "expm1", "sign", "round", "ceil", "trunc"))
fmod, lshift, rshift = (_make_binary(o) for o in ("fmod", "lshift", "rshift"))


# Activations, written with the nodes above: their derivatives, kernels and reference follow
# from those of the parts (torch's definitions; where() selects as torch's branches do).
def relu(x) -> Node:
    """``torch.relu``: x where x > 0, else 0 (gradient 0 at 0, as in torch)."""
    x = const(x)
    return where(binary("gt", x, 0), x, 0)


def leaky_relu(x, negative_slope=0.01) -> Node:
    x = const(x)
    return where(binary("gt", x, 0), x, binary("mul", x, negative_slope))


def elu(x, alpha=1.0) -> Node:
    x = const(x)
    return where(binary("gt", x, 0), x, binary("mul", unary("expm1", x), alpha))


def silu(x) -> Node:
    """``F.silu``: x * sigmoid(x)."""
    x = const(x)
    return binary("mul", x, unary("sigmoid", x))


def gelu(x, approximate: str = "none") -> Node:
    """``F.gelu``: x * Phi(x) with the erf (``approximate='none'``) or the tanh form."""
    x = const(x)
    if approximate == "tanh":
        cube = binary("mul", x, binary("mul", x, x))
        inner = binary("mul", math.sqrt(2.0 / math.pi), binary("add", x, binary("mul", 0.044715, cube)))
        return binary("mul", binary("mul", 0.5, x), binary("add", 1.0, unary("tanh", inner)))
    if approximate != "none":
        raise AttnccError(f"gelu(approximate={approximate!r}): torch takes 'none' or 'tanh'")
    return binary("mul", binary("mul", 0.5, x), binary("add", 1.0, unary("erf", binary("mul", x, math.sqrt(0.5)))))


def softplus(x, beta=1.0, threshold=20.0) -> Node:
    """``F.softplus``: log1p(exp(beta * x)) / beta, and x itself where beta * x > threshold."""
    x = const(x)
    bx = x if beta == 1 else binary("mul", x, beta)
    soft = unary("log1p", unary("exp", bx))
    return where(binary("gt", bx, threshold), x, soft if beta == 1 else binary("truediv", soft, beta))


def clamp(x, lo=None, hi=None) -> Node:
    """``torch.clamp(x, lo, hi)`` as maximum/minimum nodes (either bound may be None)."""
    x = const(x)
    if lo is not None:
        x = maximum(x, lo)
    if hi is not None:
        x = minimum(x, hi)
    return x


def walk(root: Node):
    """Every node reachable from root, each once, children before parents."""
    seen, order = set(), []

    def visit(n):
        if n in seen:
            return
        seen.add(n)
        for a in n.args:
            visit(a)
        order.append(n)
    visit(root)
    return order


def captures(*roots: Node | None) -> tuple[Capture, ...]:
    """The captured tensors the expressions read, in order of first appearance."""
    found = []
    for r in roots:
        if r is None:
            continue
        for n in walk(r):
            if n.op == "load" and n.value not in found:
                found.append(n.value)
    return tuple(found)


_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
            "pow": "**", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
            "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>"}


def to_text(n: Node, names: dict | None = None) -> str:
    """Readable infix text of an expression (captures named cap0, cap1, ... or by ``names``)."""
    if n.op in LEAVES:
        return n.op
    if n.op == "const":
        return repr(n.value)
    if n.op == "load":
        name = (names or {}).get(n.value) or n.value.name or "tensor"
        return f"{name}[{', '.join(to_text(a, names) for a in n.args)}]"
    args = [to_text(a, names) for a in n.args]
    if n.op in _SYMBOLS:
        return f"({args[0]} {_SYMBOLS[n.op]} {args[1]})"
    if n.op == "neg":
        return f"-{args[0]}"
    if n.op == "invert":
        return f"~{args[0]}"
    if n.op == "cast":
        return f"{n.value}({args[0]})"
    return f"{n.op}({', '.join(args)})"


def canonical_key(*roots: Node | None) -> str:
    """A string that identifies the expressions up to which tensors they capture: captures
    become ``capN<ndim,kind>`` in order of first appearance. Equal keys, equal kernels."""
    caps = captures(*roots)
    names = {c: f"cap{i}<{c.ndim},{c.kind}>" for i, c in enumerate(caps)}
    return " ; ".join("None" if r is None else f"{r.type}:{to_text(r, names)}" for r in roots)


def verify(score_expr: Node | None, mask_expr: Node | None) -> None:
    """Type-check the two roots: a score_mod yields a number, a mask_mod a bool."""
    if score_expr is not None:
        if "score" not in {n.op for n in walk(score_expr)} and score_expr.type == BOOL:
            raise AttnccError("score_mod returned a bool; did you mean to pass it as mask_mod?")
        if score_expr.type == BOOL:
            raise AttnccError("score_mod must return a number (the modified score), got a bool")
    if mask_expr is not None:
        if mask_expr.type == INT:
            raise AttnccError("mask_mod must return a bool (True = attend), got int; compare it "
                              "(`x != 0`) or convert it with .bool()")
        if mask_expr.type != BOOL:
            raise AttnccError(f"mask_mod must return a bool (True = attend), got {mask_expr.type}; a mod that "
                              "computes scores is a score_mod (pass it as score_mod=), and a mask returns a "
                              "comparison such as q_idx >= kv_idx")
        if "score" in {n.op for n in walk(mask_expr)}:
            raise AttnccError("mask_mod cannot read the score; use score_mod for score-dependent masking")
